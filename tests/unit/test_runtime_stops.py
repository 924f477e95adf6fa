"""Stops: EOS, stop token ids, stop strings (never in the text), max_new_tokens, ignore_eos."""

from flashx_batch import Engine, SamplingParams
from flashx_batch.runtime.sampling import SamplingParams as SP
from flashx_batch.runtime.stops import RowState


def _decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_stop_string_is_cut_from_the_text():
    row = RowState.start(SP(max_new_tokens=10, stop=("cd",)), eos_ids=(25,))
    finished = [row.append(t, _decode) for t in (0, 1, 2, 3, 4)]
    assert finished == [False, False, False, True] + [True]  # stops at the token completing "cd"
    row = RowState.start(SP(max_new_tokens=10, stop=("cd",)), eos_ids=(25,))
    for t in (0, 1, 2, 3):
        row.append(t, _decode)
    assert row.finish_reason == "stop" and row.final_text(_decode) == "ab" and row.token_ids == [0, 1, 2, 3]


def test_eos_stop_ids_and_length():
    row = RowState.start(SP(max_new_tokens=3), eos_ids=(2,))
    assert row.append(2, _decode) and row.finish_reason == "stop"
    row = RowState.start(SP(max_new_tokens=3, ignore_eos=True), eos_ids=(2,))
    assert [row.append(t, _decode) for t in (2, 2, 2)] == [False, False, True] and row.finish_reason == "length"
    row = RowState.start(SP(max_new_tokens=5, stop_token_ids=(7,), ignore_eos=True), eos_ids=(2,))
    assert not row.append(2, _decode) and row.append(7, _decode) and row.finish_reason == "stop"


def test_engine_stops_on_eos_from_generation_config(tiny_models):
    model_dir, _ = tiny_models["mistral"]
    engine = Engine.from_pretrained(model_dir, backend="cpu", dtype="float32", max_batch_size=2,
                                    max_input_len=32, max_output_len=16, segment_size=8)
    free = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=16, stop_token_ids=(stop_at,),
                                                         ignore_eos=True))[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert engine.eos_token_ids == (2,)


def test_multibyte_stop_strings_are_found_with_byte_level_tokens():
    from flashx_batch.runtime.options import bundled_model_dir
    from flashx_batch.runtime.tokenizer import Tokenizer

    tok = Tokenizer(bundled_model_dir())
    ids = tok.encode("ab结束。x\n\ny")
    for stop, text in (("。", "ab结束"), ("结束", "ab")):
        row = RowState.start(SP(max_new_tokens=50, stop=(stop,)), eos_ids=())
        for t in ids:
            if row.append(t, tok.decode):
                break
        assert row.finish_reason == "stop" and row.final_text(tok.decode) == text
