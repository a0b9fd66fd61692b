"""A session with the official `openai` Python client against `specd serve`.

Usage: python3 tests/openai_client.py http://127.0.0.1:PORT/v1
"""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")

models = client.models.list()
model = models.data[0].id
print("models:", [m.id for m in models.data])

c = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=16, temperature=0)
print("completion:", repr(c.choices[0].text), "usage:", c.usage.completion_tokens)
assert c.choices[0].finish_reason in ("stop", "length")
assert c.usage.completion_tokens > 0

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is 2 + 2?"}],
    max_tokens=24,
    temperature=0,
    extra_body={"speculation": {"proposer": "ngram"}},
)
print("chat:", repr(chat.choices[0].message.content))
assert chat.choices[0].message.role == "assistant"
spec = chat.usage.model_extra["speculation"]
print("speculation:", spec)
assert spec["proposer"] == "ngram"

pieces = []
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three colors."}],
    max_tokens=24,
    temperature=0,
    stream=True,
)
finish = None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
streamed = "".join(pieces)
print("stream:", repr(streamed), "finish:", finish)
assert streamed and finish in ("stop", "length")

same = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three colors."}],
    max_tokens=24,
    temperature=0,
)
assert same.choices[0].message.content == streamed, "streamed and non-streamed greedy text differ"

try:
    client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    raise SystemExit("expected a 400")
except openai.BadRequestError as e:
    print("error case:", e.status_code, e.body)
    assert e.status_code == 400 and e.body["param"] == "temperature", e.body

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    raise SystemExit("expected a 404")
except openai.NotFoundError as e:
    print("unknown model:", e.status_code)

print("ALL OK")
