"""OutputProcessor: finish reasons when the front end's stop strings and the core's own ends meet."""

from __future__ import annotations

from pagoda.core.outputs import EngineCoreOutput
from pagoda.engine.output_processor import OutputProcessor
from pagoda.sampling_params import SamplingParams
from tests.e2e.fake_engine import load_tokenizer


def _run(stop: str, outputs: list[tuple[str, str | None]]):
    tok = load_tokenizer()
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1], SamplingParams(max_tokens=len(outputs), stop=[stop]))
    results = []
    for text, finish in outputs:
        [token] = tok.encode(text, add_special_tokens=False)
        results.append(proc.process_outputs([EngineCoreOutput("r", [token], finish_reason=finish)]))
    return results


def test_a_stop_string_ends_the_request_and_the_core_is_told() -> None:
    (first, stop1), (second, stop2) = _run(" fox", [(" quick", None), (" fox", None)])
    assert stop1 == [] and not first[0].finished
    assert stop2 == ["r"]
    out = second[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", " fox", " quick")


def test_a_stop_string_on_the_last_allowed_token_is_a_stop_not_length() -> None:
    """The core ends the request at max_tokens ("length") on the very token that completes a
    stop string: the text is cut at the stop string, so the reason is "stop" (as in vLLM), and
    the core, which ended it already, is not asked to stop it."""
    (_, _), (second, to_stop) = _run(" fox", [(" quick", None), (" fox", "length")])
    out = second[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", " fox", " quick")
    assert to_stop == [] and second[0].finished


def test_a_one_sequence_request_reports_its_timings_when_finished() -> None:
    """RequestMetrics: the core's first scheduling, the steps of the first and last tokens
    (their timestamps), the tokens generated; only on the finished output, only for n = 1."""
    proc = OutputProcessor(load_tokenizer())
    proc.add_request("r", None, [1], SamplingParams(max_tokens=3))
    first = proc.process_outputs([EngineCoreOutput("r", [5], scheduled_time=100.5)], 101.0)[0][0]
    proc.process_outputs([EngineCoreOutput("r", [6])], 101.25)
    last = proc.process_outputs([EngineCoreOutput("r", [7], finish_reason="length")], 101.5)[0][0]
    assert first.metrics is None
    m = last.metrics
    assert (m.scheduled_time, m.first_token_time, m.last_token_time) == (100.5, 101.0, 101.5)
    assert m.num_generation_tokens == 3 and m.arrival_time > 0
    proc.add_request("two", None, [1], SamplingParams(max_tokens=1, n=2, temperature=1.0))
    outs, _ = proc.process_outputs([EngineCoreOutput(f"{i}_two", [5], finish_reason="length") for i in range(2)])
    assert outs[0].finished and outs[0].metrics is None   # two sequences: whose timings?
