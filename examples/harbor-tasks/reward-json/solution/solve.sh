#!/bin/bash
mkdir -p /app && printf "def add(a, b):\n    return a + b\n" > /app/add.py
