#!/bin/bash
# Full reward when /app/answer.txt holds the expected answer.
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "harbor" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
