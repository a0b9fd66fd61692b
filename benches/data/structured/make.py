"""Build prompts.jsonl: Spec-Bench prompts, each with the JSON schema its
answer must follow (the structured-output benchmark of `specd ab`).

    python3 benches/data/structured/make.py > benches/data/structured/prompts.jsonl

Takes the first 10 prompts of the qa, rag, summarization and
math_reasoning categories and all 10 extraction prompts, in file order.
"""
import json
import pathlib

HERE = pathlib.Path(__file__).parent
SPEC = HERE.parent / "spec_bench" / "question.jsonl"

SCHEMAS = {
    "qa": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 300},
            "confidence": {"enum": ["low", "medium", "high"]},
            "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        },
        "required": ["answer", "confidence", "topics"],
        "additionalProperties": False,
    },
    "rag": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 300},
            "evidence": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 3},
            "answerable": {"type": "boolean"},
        },
        "required": ["answer", "evidence", "answerable"],
        "additionalProperties": False,
    },
    "summarization": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "summary": {"type": "string", "maxLength": 400},
            "key_points": {"type": "array", "items": {"type": "string", "maxLength": 120}, "maxItems": 4},
        },
        "required": ["title", "summary", "key_points"],
        "additionalProperties": False,
    },
    "math_reasoning": {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 160}, "maxItems": 6},
            "final_answer": {"type": "number"},
        },
        "required": ["steps", "final_answer"],
        "additionalProperties": False,
    },
    "extraction": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 8,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 60},
                        "kind": {"enum": ["person", "organization", "place", "date", "product", "other"]},
                        "detail": {"type": "string", "maxLength": 120},
                    },
                    "required": ["name", "kind", "detail"],
                    "additionalProperties": False,
                },
            },
            "summary": {"type": "string", "maxLength": 200},
        },
        "required": ["items", "summary"],
        "additionalProperties": False,
    },
}

seen = {k: 0 for k in SCHEMAS}
for line in SPEC.read_text().splitlines():
    q = json.loads(line)
    cat = q["category"]
    if cat not in SCHEMAS or seen[cat] >= 10:
        continue
    seen[cat] += 1
    schema = SCHEMAS[cat]
    prompt = q["turns"][0] + "\n\nAnswer in JSON with this schema: " + json.dumps(schema)
    print(json.dumps({"id": f"{cat}-{q['question_id']}", "category": cat, "prompt": prompt, "schema": schema}))
