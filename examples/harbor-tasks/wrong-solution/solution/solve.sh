#!/bin/bash
# Wrong on purpose: the oracle names this task.
mkdir -p /app && echo 8 > /app/answer.txt
