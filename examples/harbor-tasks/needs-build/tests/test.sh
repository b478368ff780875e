#!/bin/bash
mkdir -p /logs/verifier
command -v jq >/dev/null && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
