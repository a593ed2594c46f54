"""SamplingParams validation, status ordering, Request bookkeeping."""

import pytest

from serving.core.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_output_kind_is_vllms_enum_and_takes_its_names_and_values():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert [int(k) for k in RequestOutputKind] == [0, 1, 2]  # vLLM's values
    assert SamplingParams(output_kind="DELTA").output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_stop_string_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("field, value, fragment", [
    ("n", 0, "n must be in [1, 128], got 0"),
    ("n", 129, "n must be in [1, 128], got 129"),
    ("temperature", -1, "temperature must be >= 0, got -1"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k must be -1 (disabled) or >= 0, got -2"),
    ("min_p", 1.5, "min_p must be in [0.0, 1.0], got 1.5"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2.0, 2.0], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2.0, 2.0], got -3"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("max_tokens", 0, "max_tokens must be >= 1 or None, got 0"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("logprobs", 21, "logprobs must be in [0, 20], got 21"),
    ("prompt_logprobs", -1, "prompt_logprobs must be in [0, 20], got -1"),
    ("seed", 1.5, "seed must be an int or None, got 1.5"),
    ("output_kind", "delta", "output_kind must be a RequestOutputKind: CUMULATIVE, DELTA, "
                             "FINAL_ONLY, got 'delta'"),
    ("output_kind", 3, "output_kind must be a RequestOutputKind"),
])
def test_sampling_params_validation_names_field_value_limit(field, value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert fragment in str(info.value)


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens=4, got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50


def test_greedy_below_sampling_eps():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_top_k_minus_one_and_zero_are_disabled():
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


def test_status_order_makes_is_finished_one_comparison():
    live = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(RequestStatus.is_finished(s) for s in live)
    done = [s for s in RequestStatus if s not in live]
    assert all(RequestStatus.is_finished(s) for s in done)
    assert max(live) < min(done)


def test_finish_reasons():
    reasons = {s: RequestStatus.finish_reason(s) for s in RequestStatus}
    assert reasons[RequestStatus.FINISHED_STOPPED] == "stop"
    assert reasons[RequestStatus.FINISHED_LENGTH_CAPPED] == "length"
    assert reasons[RequestStatus.FINISHED_ABORTED] == "abort"
    assert reasons[RequestStatus.FINISHED_ERROR] == "error"
    assert reasons[RequestStatus.RUNNING] is None


def test_request_derived_counts_and_append():
    r = Request("r", [1, 2, 3])
    r.append_output_token(7)
    r.append_output_token(8)
    assert r.all_token_ids == [1, 2, 3, 7, 8]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (5, 3, 2)
    assert r.tokens(2, 4) == [3, 7] and r.tokens(3, 5) == [7, 8] and r.token_at(4) == 8
    assert r.metrics.first_token_time is not None
    assert r.metrics.last_token_time >= r.metrics.first_token_time
    assert not r.is_finished
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.is_finished and r.finish_reason == "length"


def test_request_rejects_empty_prompt():
    with pytest.raises(ValueError, match="prompt_token_ids must be non-empty"):
        Request("r", [])


def test_outputs_shaped_like_vllm():
    c = CompletionOutput(index=0, text="hi", token_ids=[1], finish_reason="stop")
    out = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[5], prompt_logprobs=None,
                        outputs=[c], finished=True)
    assert out.outputs[0].finished() and out.outputs[0].cumulative_logprob is None


def _output(completions, finished=False, prompt_logprobs=None):
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[5],
                         prompt_logprobs=prompt_logprobs, outputs=completions, finished=finished)


def test_add_aggregates_delta_outputs_per_sample():
    """A later DELTA output folds in: each sample's text, ids and logprobs appended, its
    latest cumulative logprob and finish kept; a sample not seen yet is added; the prompt
    logprobs of the first stay; nothing of the later output's lists is shared."""
    first = _output([CompletionOutput(0, "a", [1], -0.5, [{1: -0.5}])], prompt_logprobs=[None])
    later_ids = [2, 3]
    later = _output([CompletionOutput(1, "x", [7], -0.1, [{7: -0.1}]),
                     CompletionOutput(0, "bc", later_ids, -1.5, [{2: -0.4}, {3: -0.6}],
                                      "stop", "c")], finished=True)
    first.add(later, aggregate=True)
    zero, one = first.outputs
    assert (zero.text, zero.token_ids, zero.cumulative_logprob) == ("abc", [1, 2, 3], -1.5)
    assert zero.logprobs == [{1: -0.5}, {2: -0.4}, {3: -0.6}]
    assert (zero.finish_reason, zero.stop_reason, one.index, one.text) == ("stop", "c", 1, "x")
    assert first.finished and first.prompt_logprobs == [None]
    assert zero.token_ids is not later_ids and later_ids == [2, 3]


def test_add_replaces_cumulative_outputs_per_sample():
    first = _output([CompletionOutput(0, "a", [1]), CompletionOutput(1, "x", [7])])
    first.add(_output([CompletionOutput(0, "ab", [1, 2], finish_reason="length")],
                      finished=True), aggregate=False)
    assert [(c.index, c.text, c.token_ids) for c in first.outputs] == [(0, "ab", [1, 2]),
                                                                        (1, "x", [7])]
    assert first.finished and first.outputs[0].finish_reason == "length"
