#!/bin/bash
# Full reward when /app/answer.txt holds the word the image was built with, in an image whose
# RUN step ran.
mkdir -p /logs/verifier
if [ -f /opt/task/built ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$(cat /opt/task/word.txt)" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
