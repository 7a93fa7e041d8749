#!/bin/bash
sqlite3 /app/shop.db "SELECT SUM(amount) FROM orders WHERE customer = 'ada';" > /app/answer.txt
