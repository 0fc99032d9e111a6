# stats ms per layer-seq, one block of 8 x 2048, in-situ (whatever code is installed); "res" times the torch path's reservoir only (the C call chooses it inside itself, counted in "stats")
exec(open("lab/capture_stats_insitu.py").read().split("wrap(native")[0])
model, tok, info = load_model("smollm2-135m", attn_implementation="sdpa", dtype=torch.float32)
corpus = load_corpus("pydoc")
plan = make_blocks(tok, corpus.calibration, seq_len=2048, seqs_per_block=8)
tokens, mask = plan.tokens[:1], plan.mask[:1]
tmp = Path(tempfile.mkdtemp())
meta = StoreMeta(model={k: getattr(info, k) for k in ("name", "fingerprint", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
                 corpus=corpus.to_dict(), seq_len=2048, sink=64, num_blocks=1, seqs_per_block=8, reservoir=256, config={"seed": 0, "bench": True})
wrap(C.LayerAccumulator, "_reservoir", "reservoir")
out = []
for rep in range(3):
    T.clear()
    path = tmp / f"s{rep}.zarr"
    with WriterLock(path, range(info.num_layers)):
        st = CalibStore.open_or_create(path, meta, tokens, mask)
        r = run_blocks(model, st, batch_size=1, progress=False)
    out.append((r.stats_s / 240 * 1e3, T["reservoir"] / 240 * 1e3, r.wall_s))
print(sys.argv[1], " ".join(f"stats {a:.2f} res {b:.2f} wall {c:.1f} |" for a, b, c in out))
shutil.rmtree(tmp)
