#!/bin/bash
cat /opt/task/word.txt > /app/answer.txt
