#!/bin/bash
# The reference fix: split on any whitespace.
set -euo pipefail
cd /app
sed -i 's/text.split(" ")/text.split()/' wordcount.py
