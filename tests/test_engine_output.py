"""The output rules as pure functions (engine/output.py), on hand-written cases."""
from sudu.engine.output import StopText, check_end, check_stop, split_stop_text, stop_prefix_len, token_logprob
from sudu.sampling import SamplingParams

EOS = {2}


def test_end_of_sequence_stops_unless_ignored():
    assert check_stop(2, SamplingParams(), EOS) == ("stop", 2)
    assert check_stop(2, SamplingParams(ignore_eos=True), EOS) is None
    assert check_stop(5, SamplingParams(), EOS) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    params = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert check_stop(7, params, EOS) == ("stop", 7)
    assert check_stop(2, params, EOS) is None


def test_length_comes_before_a_finished_grammar():
    assert check_end(10, 10, grammar_stopped=True) == ("length", None)
    assert check_end(9, 10, grammar_stopped=True) == ("stop", None)
    assert check_end(9, 10, grammar_stopped=False) is None


def test_stop_strings_cut_the_text_at_the_earliest_hit():
    assert split_stop_text("abc END def STOP", ["STOP", "END"]) == StopText("abc ", "", "END")
    assert split_stop_text("no stop here", ["STOP"]) == StopText("no stop here", "", None)
    assert split_stop_text("text", None) == StopText("text", "", None)


def test_a_tail_that_may_begin_a_stop_string_is_held_back():
    assert split_stop_text("hello ST", ["STOP"]) == StopText("hello ", "ST", None)
    assert split_stop_text("hello S", ["STOP", "SX"]) == StopText("hello ", "S", None)
    assert stop_prefix_len("abcST", ["STOP"]) == 2
    assert stop_prefix_len("abc", ["STOP"]) == 0
    # a stop string longer than the text: the whole text can be held
    assert stop_prefix_len("ST", ["STOPPING"]) == 2


def test_token_logprob_decodes_each_alternative_alone():
    calls = []

    def decode(ids, skip_special_tokens):
        calls.append((tuple(ids), skip_special_tokens))
        return f"<{ids[0]}>"

    entry = token_logprob(decode, 4, -0.25, [(4, -0.25), (9, -1.5)])
    assert (entry.token_id, entry.token, entry.logprob) == (4, "<4>", -0.25)
    assert entry.top == [(4, "<4>", -0.25), (9, "<9>", -1.5)]
    assert all(skip is False for _, skip in calls)
    assert token_logprob(decode, 3, -0.1, None).top == []
