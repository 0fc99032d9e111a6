"""The product goal check (validate/ppl.py) and its line in the report headline."""

import pandas as pd

from oscar.validate.ppl import product_goal


def _df(rows):
    return pd.DataFrame(rows, columns=["method", "protocol", "context", "ppl", "bits_per_element", "tokens", "ratio_vs_bf16"])


def test_goal_for_oscar_int2_and_other_recipes():
    df = _df([["bf16", "strict", 1024, 10.0, 16.0, 100, 1.0],
              ["oscar-int2", "strict", 1024, 20.0, 2.5, 100, 2.0],
              ["oscar-int2", "serving", 1024, 10.1, 2.5, 100, 1.01],   # serving rows never count
              ["oscar-kc-int2", "strict", 1024, 12.0, 2.5, 100, 1.2],
              ["oscar-kc-int2", "strict", 4096, 12.6, 2.5, 100, 1.26],  # one context over: missed
              ["oscar-ref-int2", "strict", 1024, 12.0, 3.0, 100, 1.2],  # ratio fine but 3 bits: missed
              ["kivi2", "strict", 1024, 12.0, 2.5, 100, 1.2]])         # not an OSCAR recipe: not listed
    g = product_goal(df)
    assert g["status"] == "missed" and [r["context"] for r in g["rows"]] == [1024]
    assert set(g["others"]) == {"oscar-kc-int2", "oscar-ref-int2"}
    assert g["others"]["oscar-kc-int2"]["status"] == "missed"
    assert [r["met"] for r in g["others"]["oscar-kc-int2"]["rows"]] == [True, False]
    assert g["others"]["oscar-ref-int2"]["status"] == "missed"
    ok = product_goal(df[df.context == 1024])
    assert ok["others"]["oscar-kc-int2"]["status"] == "met"
    assert product_goal(_df([]))["status"] == "not measured"
