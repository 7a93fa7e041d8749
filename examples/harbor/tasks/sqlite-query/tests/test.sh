#!/bin/bash
# The expected total is part of the hidden test (the agent may change the database).
# Writes named rewards to /logs/verifier/reward.json: `reward` is the one trained on.
got="$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)"
if [ "$got" = "2801" ]; then exact=1; else exact=0; fi
if [ -n "$got" ]; then answered=1; else answered=0; fi
echo "{\"reward\": $exact, \"answered\": $answered}" > /logs/verifier/reward.json
