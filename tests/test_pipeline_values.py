

@pytest.mark.parametrize("make_model", [BiasLM, SharedKVLM], ids=["position-bias", "shared-kv-dict"])
def test_a_model_built_on_the_meta_device_carries_what_the_whole_trace_finds(make_model) -> None:
    """Built on the meta device (``Trainer.init_module(empty_init=True)``), a model is traced on a copy of its first
    blocks; at the boundary of pp2 (block 2 of 4) the values that cross are those the trace of every block finds."""
    from lightning_par.parallel.model_map import derive_model_map
    from lightning_par.parallel.pipeline.split import _trace

    sample = torch.randint(0, VOCAB, (1, SEQ_LEN))
    whole = make_model()
    with torch.device("meta"):
        on_meta = make_model()
    model_map = derive_model_map(whole)
    exact, extrapolated = _trace(whole, model_map, sample).handoffs, _trace(on_meta, model_map, sample).handoffs
    assert exact.exact(4) and not extrapolated.exact(4)
    assert extrapolated.crossing(2, 4) == exact.crossing(2, 4) != ()
