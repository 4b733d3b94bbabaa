"""The agent of the learn_real tasks: one chat call through the gateway, the reply on stdout.

Standard library only (it runs inside the session's runtime). The worked examples in `shots.json` (uploaded
by the task) go first as earlier user/model turns: Gemma 3 270M is a base model, and two answered turns are
what tells it the shape of an answer. It samples at the temperature polar trains at (`POLAR_TEMPERATURE`,
default 1.0) and at most 8 tokens: every answer is one word.
"""

import json
import os
import sys
import urllib.request
from pathlib import Path

shots = json.loads(Path("shots.json").read_text())
question = Path(os.environ["POLAR_INSTRUCTION_FILE"]).read_text().strip()
messages = []
for shot in shots:
    messages += [{"role": "user", "content": shot["q"]}, {"role": "assistant", "content": shot["a"]}]
messages.append({"role": "user", "content": question})
body = {
    "model": os.environ["OPENAI_MODEL"],
    "messages": messages,
    "max_tokens": 8,
    "temperature": float(os.environ.get("POLAR_TEMPERATURE", "1.0")),
}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    json.dumps(body).encode(),
    {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=300) as response:
    reply = json.load(response)["choices"][0]["message"]["content"] or ""
sys.stdout.write(reply)
