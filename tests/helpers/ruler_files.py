"""Small SQuAD and HotpotQA files in the official layouts, for RULER's QA tasks (test helper, not a test)."""

import json
import random

WORDS = ("river castle garden copper lantern meadow harbor falcon violin glacier orchard pebble comet tunnel "
         "anchor basket beacon candle canyon cherry cliff cotton desert dragon engine feather forest fossil").split()


def _paragraph(rng: random.Random, k: int) -> str:
    return f"Paragraph {k} tells of " + " ".join(rng.choice(WORDS) for _ in range(70)) + "."


def squad_file(path, v2: bool = True, articles: int = 6, paras: int = 5) -> str:
    rng = random.Random(1)
    data = []
    k = 0
    for a in range(articles):
        ps = []
        for p in range(paras):
            k += 1
            qas = [{"id": f"q{k}", "question": f"What is the secret word of paragraph {k}?",
                    "answers": [{"text": f"Secret{k}", "answer_start": 0}, {"text": f"secret{k}", "answer_start": 0}]}]
            if v2:
                qas[0]["is_impossible"] = False
                qas.append({"id": f"u{k}", "question": f"Who wrote paragraph {k}?", "answers": [],
                            "plausible_answers": [{"text": "nobody", "answer_start": 0}], "is_impossible": True})
            ps.append({"context": _paragraph(rng, k) + f" The secret word is Secret{k}.", "qas": qas})
        data.append({"title": f"Article_{a}", "paragraphs": ps})
    json.dump({"version": "v2.0" if v2 else "1.1", "data": data}, open(path, "w"))
    return str(path)


def hotpot_file(path, records: int = 12, paras: int = 4) -> str:
    rng = random.Random(2)
    recs = []
    for r in range(records):
        ctx = [[f"Title {r}-{j}", [_paragraph(rng, 100 * r + j) + " ", f"Its number is {1000 * r + j}."]]
               for j in range(paras)]
        recs.append({"_id": f"h{r}", "question": f"What is the number of Title {r}-1?", "answer": str(1000 * r + 1),
                     "supporting_facts": [[f"Title {r}-1", 1]], "context": ctx, "type": "bridge", "level": "easy"})
    json.dump(recs, open(path, "w"))
    return str(path)
