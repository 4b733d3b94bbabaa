#!/bin/bash
# Harbor's verifier contract: write the reward (0 or 1) to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
cd /app
if python3 -m pytest -q /tests/test_wordcount.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
