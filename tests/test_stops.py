from pymtp.stops import StopMatcher


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return out, True
    text, hit = m.end()
    out.append(text)
    return out, hit


def test_no_stops_passes_through():
    assert feed_all(None, ["ab", "cd"]) == (["ab", "cd", ""], False)


def test_stop_inside_one_piece():
    assert feed_all(["END"], ["abcENDxyz"]) == (["abc"], True)


def test_stop_split_across_pieces_never_leaks():
    out, hit = feed_all(["END"], ["abE", "N", "Dzz"])
    assert hit and out == ["ab", "", ""]


def test_partial_stop_released_when_it_diverges():
    out, hit = feed_all(["END"], ["abE", "Nx", "y"])
    assert not hit and "".join(out) == "abENxy"
    assert out[0] == "ab"          # "E" held back: it might start "END"
    assert out[1] == "ENx"


def test_earliest_of_several_stops_wins():
    assert feed_all(["zz", "b"], ["aazzb"]) == (["aa"], True)
    assert feed_all(["\n\n", "c"], ["ab\n\ncd"]) == (["ab"], True)


def test_held_text_flushed_at_end():
    assert feed_all(["END"], ["abEN"]) == (["ab", "EN"], False)


def test_the_stop_string_that_ended_the_text_is_named():
    m = StopMatcher(["zz", "b", "\n"])
    assert m.feed("aaz") == ("aa", False) and m.matched is None
    assert m.feed("zb\n") == ("", True) and m.matched == "zz"
    m = StopMatcher(["ab", "a"])      # both found at one place: the first listed
    assert m.feed("xab") == ("x", True) and m.matched == "ab"


def _last_chunk(stops, pieces, finish="length"):
    import codecs

    from pymtp.session import step_chunk
    from pymtp.round_state import Step

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    step = Step(tokens=list(range(len(pieces))), finish=finish)
    return step_chunk(decoder, StopMatcher(stops), step, pieces)


def test_a_character_the_end_cut_short_meets_no_stop():
    """The run ends inside a character: its bytes read as U+FFFD only when the text is
    flushed, after the stops: the model wrote no such character, and llama-server meets no
    stop there (a "\ufffd" stop turned the cut into "stop"; before that, the text was cut
    at it while the chunk said "length")."""
    for stops in (["b\ufffd"], ["\ufffd"], ["c\ufffd"]):
        chunk, past = _last_chunk(stops, [b"ab", b"\xe2\x82"])        # all of it, held text too
        assert (chunk.text, chunk.finish_reason, chunk.stop_word, past) == ("ab\ufffd", "length", None, 0)
        assert chunk.tokens == [0, 1]
    chunk, _ = _last_chunk(["b"], [b"ab", b"\xe2\x82"])        # a stop before it: met
    assert (chunk.text, chunk.finish_reason, chunk.stop_word) == ("a", "stop", "b")
    # a stop held as a call's marker's start (``Stops``), met when the run ends without it
    from pymtp.stops import Stops

    chunk, _ = _last_chunk(Stops(("<",), CALLS), [b"Hi <", b"a"])
    assert (chunk.text, chunk.finish_reason, chunk.stop_word) == ("Hi ", "stop", "<")


CALLS = ("<a>", "</a>")


def _whole(stops, text):
    """``text`` fed whole, then a piece at a time, one split after another: the same."""
    first = "".join(feed_all(stops, [text])[0]), feed_all(stops, [text])[1]
    for size in range(1, 5):
        out, hit = feed_all(stops, [text[i:i + size] for i in range(0, len(text), size)])
        assert ("".join(out), hit) == first, size
    return first


def test_a_stop_does_not_match_inside_a_calls_block():
    """Stop strings a call's JSON or markup holds (a quote, a newline) end the text around
    the calls, not inside one: a cut call was neither a call nor readable text."""
    from pymtp.stops import Stops

    stops = Stops(("\n", '"'), CALLS)
    assert _whole(stops, 'Hi<a>\n{"k": 1}\n</a>\nmore') == ('Hi<a>\n{"k": 1}\n</a>', True)
    assert _whole(stops, 'Hi "there" <a>x</a>') == ("Hi ", True)       # before the block: as ever
    assert _whole(stops, '<a>\n"</a><a>"\n</a>') == ('<a>\n"</a><a>"\n</a>', False)     # two blocks
    assert _whole(stops, '<a>\n"x"') == ('<a>\n"x"', False)             # a block the text ends in
    # a stop that begins before the opening marker ends the text there; one that begins at it
    # or inside the block (a closing marker too) is the block's text
    assert _whole(Stops(("i<a",), CALLS), "Hi<a>b</a>") == ("H", True)
    assert _whole(Stops(("<a>", "</a>", "a"), CALLS), "<a>b</a>") == ("<a>b</a>", False)
    assert _whole(Stops(("a",), CALLS), "<a>b</a>a") == ("<a>b</a>", True)
    # a stop that begins before the marker and ends past it, whole or a piece at a time
    assert _whole(Stops(("x<a>y",), CALLS), "x<a>y") == ("", True)
    assert _whole(Stops(("\n<a>\n",), CALLS), "Hi\n<a>\n{}") == ("Hi", True)
    # a stop held as a marker's start is met at the end when the marker never came
    assert _whole(Stops(("<",), CALLS), "Hi <a") == ("Hi ", True)
    # what may begin a marker is held like a stop's start, and let go where it does not
    m = StopMatcher(Stops(("!",), CALLS))
    assert m.feed("x<") == ("x", False) and m.feed("b") == ("<b", False)
    assert m.feed("<a>\n</") == ("<a>\n", False) and m.feed("a>!") == ("</a>", True)


def test_a_closing_marker_inside_a_value_does_not_end_the_block():
    """A call's JSON string (or an XML form's argument) may hold ``</tool_call>``: the
    parser reads on past it (tool_reply.in_value), and so do the stops."""
    from pymtp.stops import Stops
    from pymtp.tool_reply import in_value

    stops = Stops(('"', "\n"), ("<tool_call>", "</tool_call>"), in_value)
    call = '<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>\\"</tool_call>"}}</tool_call>'
    assert _whole(stops, call + '\nmore') == (call, True)
    xml = "<tool_call>\n<function=f>\n<parameter=s>\n</tool_call>\n</parameter>\n</function>\n</tool_call>"
    assert _whole(stops, xml + '"') == (xml, True)


def test_a_calls_marker_in_the_leading_thinking_opens_no_block():
    """A reply whose thinking is read apart has no calls there: a ``<tool_call>`` the model
    wrote while thinking held every stop off for the rest of the reply. Stops match in the
    thinking as in any text (one across its end tag too)."""
    from pymtp.stops import Stops

    opened = Stops(("STOP",), CALLS, thinking=True)
    assert _whole(opened, "a <a> b</think>\n\nok STOP more") == ("a <a> b</think>\n\nok ", True)
    assert _whole(opened, "a STOP b</think>") == ("a ", True)
    assert _whole(opened, "a</think><a>STOP</a>STOP") == ("a</think><a>STOP</a>", True)     # calls after it
    assert _whole(Stops(("k>\n\nok",), CALLS, thinking=True), "a</think>\n\nok") == ("a</thin", True)
    assert _whole(Stops(("</think>",), CALLS, thinking=True), "a</think>b") == ("a", True)
    may = Stops(("STOP",), CALLS, thinking=False)       # the reply may open its block itself
    assert _whole(may, " \n<think>x<a>y</think>z STOP w") == (" \n<think>x<a>y</think>z ", True)
    assert _whole(may, "<a>STOP</a> STOP") == ("<a>STOP</a> ", True)       # no block: calls count at once
    assert _whole(may, "x <think><a>STOP") == ("x <think><a>STOP", False)   # a block later is no thinking
    assert _whole(may, "<thi") == ("<thi", False)
    # without thinking read apart, the block's marker counts wherever it is
    assert _whole(Stops(("STOP",), CALLS), "a <a> b</think> STOP") == ("a <a> b</think> STOP", False)


def test_any_split_of_a_text_gives_what_the_whole_gives():
    """Random texts over the markers' and stops' letters, fed in random pieces."""
    import random

    from pymtp.stops import Stops

    rng = random.Random(81)
    for _ in range(3000):
        text = "".join(rng.choice(["<a>", "</a>", "<", "a", ">", "/", "x", "\n", "<think>", "</think>", " "])
                       for _ in range(rng.randint(0, 12)))
        stops = Stops(tuple(rng.sample(["x", "\n", "a>", "x<a", "<a>x", "/a", "x\nx", "k>", "</think>\n"],
                                       rng.randint(1, 3))), CALLS, thinking=rng.choice([None, False, True]))
        whole = feed_all(stops, [text])
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        split = feed_all(stops, pieces)
        assert ("".join(split[0]), split[1]) == ("".join(whole[0]), whole[1]), (stops, pieces)


def test_a_chat_with_tools_matches_its_stops_outside_its_calls():
    """``ToolPlan.stops``: a request read for calls; under "none" the stops are as given."""
    from pymtp.stops import Stops
    from pymtp.tools import ToolPlan
    from test_tools import ADD

    from pymtp.tool_reply import in_value

    for choice in ("auto", "required"):
        assert ToolPlan.of([ADD], choice).stops(["\n"]) == Stops(("\n",), ("<tool_call>", "</tool_call>"), in_value)
    assert ToolPlan.of([ADD], "none").stops(["\n"]) == ["\n"]
