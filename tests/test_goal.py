"""The product goal check (validate/ppl.py) and its line in the report headline."""

import pandas as pd

from oscar.validate.evidence import product_goal


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


def test_thin_margin_is_flagged_either_side_of_the_limit():
    rows = [["bf16", "strict", 1024, 10.0, 16.0, 100, 1.0], ["oscar-int2", "strict", 1024, 11.6, 2.5, 100, 1.16],
            ["oscar-int2", "strict", 4096, 12.4, 2.5, 100, 1.242]]
    g = product_goal(_df(rows))
    assert g["status"] == "met" and g["thin_margin_contexts"] == [4096]
    rows[2][-1] = 1.26  # just over: missed, and just as thin
    g = product_goal(_df(rows))
    assert g["status"] == "missed" and g["thin_margin_contexts"] == [4096]
    rows[2][-1] = 1.20
    assert "thin_margin_contexts" not in product_goal(_df(rows))


def test_report_headline_says_thin_margin(tmp_path):
    import json

    from oscar.reports.build import build_report

    df = _df([["bf16", "strict", 4096, 10.0, 16.0, 100, 1.0], ["oscar-int2", "strict", 4096, 12.42, 2.5, 100, 1.242]])
    df.to_parquet(tmp_path / "ppl.parquet", index=False)
    json.dump(product_goal(df), open(tmp_path / "goal.json", "w"))
    build_report(str(tmp_path))
    md = open(tmp_path / "report.md").read()
    assert "**Product goal" in md and ": MET**" in md
    assert "Thin margin at 4k" in md
