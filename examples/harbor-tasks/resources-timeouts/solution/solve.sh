#!/bin/bash
mkdir -p /app/out && touch /app/out/done
