"""Model loads from several threads keep transformers' weight tying working."""

import contextlib
import threading

import pytest
import torch

from offbeat.core.models import build_tiny_model, check_tied, load_causal_lm


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("hf") / "tied", num_hidden_layers=1, tie_word_embeddings=True
    )


@pytest.fixture
def slow_no_tie(monkeypatch):
    """transformers' own save/restore of `PreTrainedModel.tie_weights`, with the one
    interleaving that loses the original forced when two loads overlap inside it: the
    first in waits (up to 2 s) for a second to enter, and the second restores only after
    the first has. Loads that are serialised never overlap, so the first's wait runs out
    and each restores what it found. Yields the entries and the original."""
    import transformers.initialization as init
    from transformers import PreTrainedModel

    original_tie = PreTrainedModel.tie_weights
    entered = []
    lock = threading.Lock()
    second_in, first_out = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def no_tie_weights():
        with lock:
            saved = PreTrainedModel.tie_weights
            PreTrainedModel.tie_weights = lambda *a, **k: None
            order = len(entered)
            entered.append(threading.current_thread().name)
        if order == 0:
            second_in.wait(timeout=2.0)
        else:
            second_in.set()
        try:
            yield
        finally:
            if order > 0:
                assert first_out.wait(timeout=60), "the first load never left"
            PreTrainedModel.tie_weights = saved
            if order == 0:
                first_out.set()

    monkeypatch.setattr(init, "no_tie_weights", no_tie_weights)
    yield entered, original_tie
    PreTrainedModel.tie_weights = original_tie  # whatever the test did


def _in_two_threads(fn):
    start = threading.Barrier(2)
    out, errors = [], []

    def run():
        start.wait()
        try:
            out.append(fn())
        except Exception as e:  # handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, name=f"load-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, errors


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_unserialised_loads_in_two_threads_switch_tying_off_for_good(tied_dir, slow_no_tie):
    # The hazard itself: two plain from_pretrained calls at once leave tie_weights a no-op.
    from transformers import AutoModelForCausalLM, PreTrainedModel

    entered, original_tie = slow_no_tie
    _in_two_threads(lambda: AutoModelForCausalLM.from_pretrained(tied_dir))
    assert len(entered) == 2
    assert PreTrainedModel.tie_weights is not original_tie
    assert not _tied(AutoModelForCausalLM.from_pretrained(tied_dir))


def test_load_causal_lm_in_two_threads_keeps_tying(tied_dir, slow_no_tie):
    from transformers import PreTrainedModel

    entered, original_tie = slow_no_tie
    models, errors = _in_two_threads(lambda: load_causal_lm(tied_dir, dtype=torch.float32))
    assert not errors and len(models) == 2 and len(entered) == 2
    assert all(_tied(m) for m in models)
    assert PreTrainedModel.tie_weights is original_tie
    assert _tied(load_causal_lm(tied_dir))


def test_a_tied_config_loaded_untied_is_refused(tied_dir, slow_no_tie):
    from transformers import AutoModelForCausalLM, PreTrainedModel

    PreTrainedModel.tie_weights = lambda *a, **k: None  # as the race above leaves it
    with pytest.raises(RuntimeError, match="ties the word embeddings"):
        load_causal_lm(tied_dir)
    with pytest.raises(RuntimeError, match="load_causal_lm"):
        check_tied(AutoModelForCausalLM.from_pretrained(tied_dir), tied_dir)


def test_an_untied_model_passes_the_check(tmp_path):
    model = load_causal_lm(build_tiny_model(tmp_path / "untied", num_hidden_layers=1))
    assert not _tied(model)
    check_tied(model)
