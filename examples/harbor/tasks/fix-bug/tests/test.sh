#!/bin/bash
# Run the hidden test; reward 1 when it passes.
if python3 /tests/test_calc.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
