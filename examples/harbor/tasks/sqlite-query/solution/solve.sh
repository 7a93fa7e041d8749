#!/bin/bash
# Python's sqlite3 module (the sqlite3 command-line tool may not be installed).
python3 - <<'PY'
import sqlite3
total = sqlite3.connect("/app/shop.db").execute(
    "SELECT SUM(amount) FROM orders WHERE customer = 'ada'").fetchone()[0]
open("/app/answer.txt", "w").write(f"{total}\n")
PY
