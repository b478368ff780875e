#!/bin/bash
# Named rewards: the reward, and a partial score beside it.
mkdir -p /logs/verifier
cd /app 2>/dev/null || true
if python3 -c "from add import add; assert add(2, 3) == 5 and add(-1, 1) == 0" 2>/dev/null; then
  echo "{\"reward\": 1.0, \"cases\": 2}" > /logs/verifier/reward.json
else
  echo "{\"reward\": 0.0, \"cases\": 0}" > /logs/verifier/reward.json
fi
