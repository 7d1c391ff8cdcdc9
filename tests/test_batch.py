"""Batch metadata: the host-side builder (layout, padding, validation messages), the
device-side validation (batch_status) and the vLLM metadata converter."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from gdn_jax.batch import (PAD_SLOT_ID, ROW_DECODE, ROW_PAD, ROW_PREFILL, ROW_SPEC, BatchBuilder, BatchMetadata,
                           Request, batch_status, build_batch, from_vllm_metadata, status_message)
from gdn_jax import native_available
from gdn_jax.config import GDNConfig

N = 16


def _build(reqs, num_spec=3, T=32, S=8, **kw):
    return build_batch(reqs, num_slots=N, num_spec=num_spec, token_bucket=T, row_bucket=S, **kw)


# --- layout ---------------------------------------------------------------------------------


def test_layout_orders_and_pads():
    reqs = [Request.prefill(3, 5, id="p0"), Request.spec((4, 5, 6, 7), 3, num_accepted=2, id="s0"),
            Request.decode(1, id="d0"), Request.prefill(9, 2, has_initial_state=True, id="p1")]
    hb = _build(reqs)
    m = hb.metadata
    # decode, spec, prefill (stable), then padding rows
    assert m.row_kind.tolist() == [ROW_DECODE, ROW_SPEC, ROW_PREFILL, ROW_PREFILL, ROW_PAD, ROW_PAD, ROW_PAD, ROW_PAD]
    assert m.query_start_loc.tolist() == [0, 1, 4, 9, 11, 11, 11, 11, 11]
    assert m.state_indices.tolist()[:4] == [[1, -1, -1, -1], [4, 5, 6, 7], [3, -1, -1, -1], [9, -1, -1, -1]]
    assert (m.state_indices[4:] == PAD_SLOT_ID).all()
    assert m.num_accepted_tokens.tolist() == [1, 2, 1, 1, 1, 1, 1, 1]
    assert m.has_initial_state.tolist()[:4] == [True, True, False, True]
    assert int(m.num_tokens) == 11
    assert hb.rows == (2, 1, 0, 3)
    assert hb.token_slices == ((4, 9), (1, 4), (0, 1), (9, 11))
    assert hb.token_bucket == 32 and hb.row_bucket == 8
    tr = hb.token_row()
    assert tr.tolist()[:12] == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, -1]
    # dtypes and shapes the device side expects
    m.check_shapes(3)
    assert m.query_start_loc.dtype == np.int32 and m.state_indices.dtype == np.int32
    assert m.has_initial_state.dtype == bool


def test_keep_order_and_pack_unpack():
    reqs = [Request.prefill(3, 2), Request.decode(1), Request.prefill(5, 3)]
    hb = _build(reqs, num_spec=0, T=8, S=4, reorder=False)
    assert hb.metadata.row_kind.tolist() == [ROW_PREFILL, ROW_DECODE, ROW_PREFILL, ROW_PAD]
    per = [np.full((2, 3), 1.0), np.full((1, 3), 2.0), np.full((3, 3), 3.0)]
    packed = hb.pack(per)
    assert packed.shape == (8, 3)
    assert packed[:, 0].tolist() == [1, 1, 2, 3, 3, 3, 0, 0]
    back = hb.unpack(packed)
    for p, q in zip(per, back):
        np.testing.assert_array_equal(p, q)
    with pytest.raises(ValueError, match=r"request 1 \(decode\) needs an array of shape \(1, 3\)"):
        hb.pack([per[0], np.zeros((2, 3)), per[2]])


def test_bucket_choice():
    reqs = [Request.prefill(0, 10), Request.decode(1)]
    hb = build_batch(reqs, num_slots=N, token_bucket=(8, 16, 64), row_bucket=(2, 4))
    assert (hb.token_bucket, hb.row_bucket) == (16, 2)
    with pytest.raises(ValueError, match="the step needs 11 tokens but the largest tokens bucket holds 8"):
        build_batch(reqs, num_slots=N, token_bucket=(4, 8), row_bucket=4)
    with pytest.raises(ValueError, match="the step needs 2 rows but the rows bucket holds 1"):
        build_batch(reqs, num_slots=N, token_bucket=16, row_bucket=1)


def test_builder_object_and_empty():
    cfg = GDNConfig(1, 2, 16, 16, num_spec=2)
    bb = BatchBuilder.for_config(cfg, num_slots=N, token_bucket=16, row_bucket=4)
    hb = bb.build([])
    assert hb.metadata.row_kind.tolist() == [0, 0, 0, 0]
    assert hb.metadata.state_indices.shape == (4, 3)
    assert int(hb.metadata.num_tokens) == 0
    e = BatchMetadata.empty(3, 2)
    assert e.query_start_loc.tolist() == [0, 0, 0, 0]


# --- host validation: every mistake names the request and the value -------------------------

BAD = [
    ([Request("chat", 1, (0,))], "request 0 \\(chat\\): kind must be 'prefill', 'decode' or 'spec', got 'chat'"),
    ([Request.prefill(0, 0)], "request 0 \\(prefill\\): num_tokens must be an int >= 1, got 0"),
    ([Request.prefill(0, 2), Request.decode(0, id="r7")],
     "request 1 \\(id='r7', decode\\): slot 0 is also named by request 0 \\(prefill\\); a slot may be named once"),
    ([Request.prefill(N, 2, id="big")], f"request 0 \\(id='big', prefill\\): slot {N} is outside \\[0, {N}\\)"),
    ([Request.decode(-1)], f"request 0 \\(decode\\): slot -1 is outside \\[0, {N}\\)"),
    ([Request("decode", 2, (1,), has_initial_state=True)], "a decode row has exactly 1 token, got 2"),
    ([Request("decode", 1, (1,), has_initial_state=False)], "a decode row always continues from its slot"),
    ([Request.prefill(1, 3), Request("prefill", 2, (2,), num_accepted=2)],
     "request 1 \\(prefill\\): num_accepted must be 1 on a prefill row"),
    ([Request("prefill", 2, (2, 3))], "a prefill row names exactly one slot, got 2"),
    ([Request.spec((1, 2, 3, 4), 5)], "a spec row has at most num_spec \\+ 1 = 4 tokens \\(1 \\+ drafts\\), got 5"),
    ([Request.spec((1, 2, 3, 4), 2, num_accepted=0)], "num_accepted must be in \\[1, num_spec \\+ 1 = 4\\], got 0"),
    ([Request.spec((1, 2, 3, 4), 2, num_accepted=5)], "num_accepted must be in \\[1, num_spec \\+ 1 = 4\\], got 5"),
    ([Request.spec((1, 2, 3), 2)], "a spec row names num_spec \\+ 1 = 4 slots \\(its block-table row\\), got 3"),
    ([Request.spec((1, 2, 3, 99), 4)], f"slot 99 \\(column 3\\) is outside \\[0, {N}\\)"),
    ([Request.spec((1, -1, 3, 4), 2)], f"slot -1 \\(column 1\\) is outside \\[0, {N}\\)"),
    ([Request.spec((1, 2, 3, 99), 2)],
     f"slot 99 \\(column 3, unused by this row's 2 tokens and num_accepted 1\\) must be -1 or in \\[0, {N}\\)"),
    ([Request.spec((1, 2, 2, 4), 3, id="d")],
     "request 0 \\(id='d', spec\\): slot 2 is named by columns 1 and 2; each token's state needs a slot"),
    ([Request.spec((1, 2, 3, 4), 2), Request.spec((5, 6, 7, 2), 4, id="x")],
     "request 1 \\(id='x', spec\\): slot 2 is also named by request 0 \\(spec\\)"),
    ([Request("spec", 2, (1, 2, 3, 4), has_initial_state=False)], "has_initial_state must be True"),
    ([Request.prefill(1, 30), Request.prefill(2, 3)], "the step needs 33 tokens but the tokens bucket holds 32"),
    ([Request.decode(i) for i in range(9)], "the step needs 9 rows but the rows bucket holds 8"),
    ([Request.prefill(1.5, 2)], "slots must be ints"),
]


@pytest.mark.parametrize("reqs,msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_builder_rejects(reqs, msg):
    with pytest.raises(ValueError, match=msg):
        _build(reqs)


def test_spec_row_needs_num_spec():
    with pytest.raises(ValueError, match="a spec row needs a config with num_spec > 0"):
        _build([Request.spec((1,), 1)], num_spec=0)


# --- device validation ----------------------------------------------------------------------

ALL = (ROW_PAD, ROW_PREFILL, ROW_DECODE, ROW_SPEC)


IMPLS = ["reference"] + (["native"] if native_available() else [])


@pytest.fixture(params=IMPLS)
def impl(request):
    """The jnp batch_status and its native form (one custom call) must give the same answers."""
    return request.param


@functools.lru_cache(maxsize=None)
def _status_fn(T, kinds, impl):
    return jax.jit(lambda m: batch_status(m, num_tokens=T, num_slots=N, kinds=kinds, impl=impl))


def _status(m, impl, T=32, kinds=ALL):
    return np.asarray(_status_fn(T, kinds, impl)(m.to_device()))


def _good():
    return _build([Request.decode(1), Request.spec((4, 5, 6, 7), 3, num_accepted=2), Request.prefill(3, 5)]).metadata


def _edit(m, **changes):
    m = dataclasses.replace(m, **{k: np.array(v) for k, v in
                                  dataclasses.asdict(m).items()})  # deep copy
    for field, fn in changes.items():
        arr = getattr(m, field)
        fn(arr)
    return m


def test_status_ok(impl):
    assert _status(_good(), impl).tolist() == [0, 0, 0, 0]
    assert status_message("x", _status(_good(), impl)) is None


def _set(path_value):
    def f(arr):
        idx, val = path_value
        arr[idx] = val
    return f


DEVICE_BAD = [
    # (edits, code, row, value, aux, message fragment)
    (dict(query_start_loc=_set((0, 1))), 1, 0, 1, 0, "query_start_loc\\[0\\] must be 0, got 1"),
    (dict(query_start_loc=_set((2, 0))), 2, 1, 0, 1, "must be non-decreasing"),
    (dict(query_start_loc=_set((slice(4, None), 40))), 3, 8, 40, 32, "is past the number of tokens T = 32"),
    (dict(state_indices=_set(((0, 0), 16))), 4, 0, 16, 0, "row 0: slot 16 \\(column 0\\) is outside \\[0, N\\)"),
    (dict(state_indices=_set(((1, 2), -3))), 4, 1, -3, 2, "row 1: slot -3 \\(column 2\\)"),
    (dict(state_indices=_set(((2, 0), 5))), 5, 2, 5, 1, "row 2: slot 5 is also named by row 1"),
    (dict(num_accepted_tokens=_set((1, 0))), 6, 1, 0, 4, "num_accepted_tokens = 0 is outside \\[1, 4\\]"),
    (dict(num_accepted_tokens=_set((1, 5))), 6, 1, 5, 4, "num_accepted_tokens = 5 is outside"),
    (dict(num_accepted_tokens=_set((0, 2))), 19, 0, 2, ROW_DECODE, "num_accepted_tokens = 2 on a decode row"),
    (dict(row_kind=_set((0, 7))), 16, 0, 7, 15, "row_kind 7 \\(unknown kind\\) is not one this step takes"),
    (dict(row_kind=_set((4, ROW_PREFILL))), 17, 4, ROW_PREFILL, -1, "does not match its column-0 slot -1"),
    (dict(state_indices=_set(((5, 0), 9))), 17, 5, ROW_PAD, 9, "row_kind 0 \\(padding\\) does not match"),
    (dict(row_kind=_set((2, ROW_DECODE))), 18, 2, 5, 0, "a decode row has 5 tokens; it must have exactly 1"),
    (dict(row_kind=_set((2, ROW_SPEC))), 7, 2, 5, 4, "row 2: 5 tokens, more than the 4 this path allows"),
]


@pytest.mark.parametrize("edits,code,row,value,aux,frag", DEVICE_BAD, ids=[f"dev{i}" for i in range(len(DEVICE_BAD))])
def test_device_status(edits, code, row, value, aux, frag, impl):
    m = _edit(_good(), **edits)
    st = _status(m, impl)
    assert st.tolist() == [code, row, value, aux]
    msg = status_message("gdn_attention_core", st)
    assert msg.startswith("gdn_jax.gdn_attention_core: invalid batch, nothing was written: ")
    assert len(__import__("re").findall(frag, msg)) == 1, msg


def test_device_status_kinds_per_path(impl):
    m = _good()
    st = _status(m, impl, kinds=(ROW_PAD, ROW_PREFILL))
    assert st.tolist() == [16, 0, ROW_DECODE, 0b11]
    assert "row 0: row_kind 2 (decode) is not one this step takes (padding, prefill)" in status_message("prefill", st)
    st = _status(m, impl, kinds=(ROW_PAD, ROW_DECODE, ROW_SPEC))
    assert st.tolist()[:2] == [16, 2]


def test_device_duplicate_inside_one_row_is_refused(impl):
    # Row 1 (spec, 3 tokens, acc 2) writing tokens 1 and 2 to slot 5 would leave token 1's state
    # replaced by token 2's: one slot named twice in a step, as across rows.
    m = _edit(_good(), state_indices=_set(((1, 2), 5)))
    st = _status(m, impl)
    assert st.tolist() == [8, 1, 5, 1]
    assert "row 1: slot 5 is named by two of its used columns" in status_message("x", st)
    # The read column (acc - 1 = 1) against a written one clashes too.
    assert _status(_edit(_good(), state_indices=_set(((1, 0), 5))), impl).tolist() == [8, 1, 5, 1]
    # An unused column (>= max(q, acc) = 3) may repeat a used one.
    assert _status(_edit(_good(), state_indices=_set(((1, 3), 4))), impl).tolist() == [0, 0, 0, 0]
    # Across rows the clash is reported first when its slot sorts first.
    m = _edit(_good(), state_indices=_set(((1, 2), 5)))
    m.state_indices[2, 0] = 4
    assert _status(m, impl).tolist() == [5, 2, 4, 1]


def test_host_builder_allows_a_repeat_in_unused_spec_columns():
    # One token, acc 1: only column 0 is used, so columns 1 and 2 may repeat a slot.
    hb = _build([Request.spec((1, 2, 2, 4), 1)])
    assert hb.metadata.state_indices.tolist()[0] == [1, 2, 2, 4]


def test_host_builder_takes_pad_and_other_rows_slots_in_unused_spec_columns(impl):
    """Columns from max(q, acc) on are not used (never read or written): they may hold -1, as
    the contract allows, or a slot another row uses, as the device check allows."""
    hb = _build([Request.spec((1, -1, -1, -1), 1), Request.spec((2, 3, -1, -1), 1, num_accepted=2),
                 Request.decode(5), Request.spec((6, 7, 5, 1), 2)])
    assert hb.metadata.state_indices.tolist()[:4] == [[5, -1, -1, -1], [1, -1, -1, -1], [2, 3, -1, -1],
                                                      [6, 7, 5, 1]]
    assert _status(hb.metadata, impl).tolist() == [0, 0, 0, 0]
    # A used column still may not name another row's slot.
    with pytest.raises(ValueError, match=r"request 1 \(spec\): slot 5 is also named by request 0 \(decode\)"):
        _build([Request.decode(5), Request.spec((6, 7, 5, 1), 3)])


def test_device_unused_spec_columns_are_not_checked(impl):
    # Columns >= max(q, acc) are neither read nor written.
    m = _edit(_good(), state_indices=_set(((1, 3), 999)))
    assert _status(m, impl).tolist() == [0, 0, 0, 0]
    m = _edit(_good(), state_indices=_set(((1, 2), 999)))
    assert _status(m, impl).tolist() == [4, 1, 999, 2]


def test_every_host_error_is_also_a_device_error(impl):
    """Metadata written by hand (bypassing the builder) with the builder's mistakes is refused."""
    base = _good()
    cases = [
        _edit(base, state_indices=_set(((2, 0), 1))),               # slot named twice
        _edit(base, num_accepted_tokens=_set((1, 9))),              # accepted out of range
        _edit(base, query_start_loc=_set((slice(1, None), 33))),    # past the bucket
    ]
    for m in cases:
        assert _status(m, impl)[0] != 0


@pytest.mark.skipif("native" not in IMPLS, reason="native extension not built")
def test_native_batch_status_agrees_with_jnp_on_random_corruptions():
    """Random edits of valid batches (any field, including several at once, duplicate slots,
    unknown kinds, wrong lengths): the native check and the jnp one report the same
    (code, row, value, aux), and both refuse what the other refuses."""
    rng = np.random.default_rng(7)
    base = [_good(), _build([Request.spec((1, 2, 3, 4), 4, num_accepted=4), Request.spec((5, 6, 7, 8), 1)]).metadata,
            _build([Request.prefill(2, 20), Request.decode(3), Request.decode(4)]).metadata]
    fields = ("query_start_loc", "state_indices", "row_kind", "num_accepted_tokens")
    codes = set()
    for trial in range(400):
        m = dataclasses.replace(base[trial % len(base)])
        m = _edit(m)
        for _ in range(int(rng.integers(1, 4))):
            f = fields[int(rng.integers(len(fields)))]
            arr = getattr(m, f)
            pos = tuple(int(rng.integers(n)) for n in arr.shape)
            arr[pos] = int(rng.choice([-2, -1, 0, 1, 2, 3, 4, 5, 9, 15, 16, 31, 33]))
        got = {i: _status(m, i).tolist() for i in IMPLS}
        assert got["native"] == got["reference"], (trial, m, got)
        codes.add(got["native"][0])
    assert len(codes) >= 8, codes  # the corruptions reach most checks


# --- vLLM metadata ---------------------------------------------------------------------------


def test_from_vllm_non_spec():
    # 2 decodes then 2 prefills (the second a continuation) and a trailing zero-length row.
    hb = from_vllm_metadata(num_slots=N, num_spec=0, token_bucket=16, row_bucket=8,
                            non_spec_query_start_loc=[0, 1, 2, 6, 9, 9], non_spec_state_indices=[4, 2, 7, 1, 0],
                            num_decodes=2, has_initial_state=[True, True, False, True, False])
    m = hb.metadata
    assert m.row_kind.tolist()[:5] == [ROW_DECODE, ROW_DECODE, ROW_PREFILL, ROW_PREFILL, ROW_PAD]
    assert m.query_start_loc.tolist()[:5] == [0, 1, 2, 6, 9]
    assert m.state_indices[:4, 0].tolist() == [4, 2, 7, 1]
    assert m.has_initial_state.tolist()[:4] == [True, True, False, True]


def test_from_vllm_mixed_spec(impl):
    # vLLM batch of 3 rows: spec (q=4), non-spec prefill (q=3), spec (q=2; its unused columns -1,
    # PAD_SLOT_ID); tokens interleaved.
    hb = from_vllm_metadata(num_slots=N, num_spec=3, token_bucket=16, row_bucket=4,
                            spec_sequence_masks=[True, False, True],
                            spec_query_start_loc=[0, 4, 6], spec_state_indices=[[1, 2, 3, 4], [5, 6, -1, -1]],
                            num_accepted_tokens=[2, 1],
                            non_spec_query_start_loc=[0, 3], non_spec_state_indices=[9],
                            has_initial_state=[False])
    m = hb.metadata
    assert m.row_kind.tolist() == [ROW_SPEC, ROW_PREFILL, ROW_SPEC, ROW_PAD]
    assert m.query_start_loc.tolist() == [0, 4, 7, 9, 9]   # vLLM's token order kept
    assert m.state_indices.tolist()[:3] == [[1, 2, 3, 4], [9, -1, -1, -1], [5, 6, -1, -1]]
    assert m.num_accepted_tokens.tolist()[:3] == [2, 1, 1]
    assert _status(m, impl, T=16).tolist() == [0, 0, 0, 0]


def test_from_vllm_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="spec_sequence_masks has 1 spec and 0 non-spec rows"):
        from_vllm_metadata(num_slots=N, num_spec=3, token_bucket=16, row_bucket=4, spec_sequence_masks=[True],
                           spec_query_start_loc=[0, 4, 6], spec_state_indices=[[1, 2, 3, 4], [5, 6, 7, 8]],
                           num_accepted_tokens=[1, 1])


def test_device_status_single_row_single_column(impl):
    """One row bucket without spec columns: nothing can clash (a 1-element sort), and a bad
    slot is still found."""
    m = _build([Request.prefill(3, 7)], num_spec=0, T=8, S=1).metadata
    assert _status(m, impl, T=8).tolist() == [0, 0, 0, 0]
    bad = _edit(m, state_indices=_set(((0, 0), 99)))
    assert _status(bad, impl, T=8).tolist() == [4, 0, 99, 0]


def test_from_vllm_refuses_query_start_locs_and_flags_that_do_not_line_up():
    """A decreasing or shifted query_start_loc (a negative-length row was dropped silently, the
    token count changed) and a has_initial_state that is not one flag per non-spec row (read
    misaligned: a stale slot taken for history) are ValueErrors naming the field."""
    kw = dict(num_slots=N, num_spec=0, token_bucket=16, row_bucket=4)
    with pytest.raises(ValueError, match=r"non_spec_query_start_loc must be non-decreasing: .*\[2\] = 3 < .*\[1\] = 5"):
        from_vllm_metadata(non_spec_query_start_loc=[0, 5, 3, 8], non_spec_state_indices=[1, 2, 3], **kw)
    with pytest.raises(ValueError, match="non_spec_query_start_loc must be a 1-D cumsum starting at 0"):
        from_vllm_metadata(non_spec_query_start_loc=[2, 5, 8], non_spec_state_indices=[1, 2], **kw)
    with pytest.raises(ValueError, match="spec_query_start_loc must be non-decreasing"):
        from_vllm_metadata(num_slots=N, num_spec=1, token_bucket=16, row_bucket=4, spec_sequence_masks=[True, True],
                           spec_query_start_loc=[0, 2, 1], spec_state_indices=[[1, 2], [3, 4]],
                           num_accepted_tokens=[1, 1])
    for flags in ([True, False, True], [True]):  # per request (3 rows, 1 of them spec) / too short
        with pytest.raises(ValueError, match=r"has_initial_state must have one entry per non-spec row \(2\)"):
            from_vllm_metadata(num_slots=N, num_spec=1, token_bucket=16, row_bucket=4,
                               spec_sequence_masks=[True, False, False], spec_query_start_loc=[0, 2],
                               spec_state_indices=[[6, 7]], num_accepted_tokens=[1],
                               non_spec_query_start_loc=[0, 4, 7], non_spec_state_indices=[1, 2],
                               has_initial_state=flags)


def test_builder_for_a_layer_config():
    from gdn_jax.layer import GDNLayerConfig
    core = GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, num_spec=2)
    b = BatchBuilder.for_config(GDNLayerConfig(hidden_size=32, core=core), num_slots=8, token_bucket=8,
                                row_bucket=2)
    assert b.num_spec == 2 and b.build([Request.spec((0, 1, 2), 3)]).metadata.state_indices.shape == (2, 3)


def test_host_metadata_outside_int32_is_refused_not_wrapped():
    """With x64 off jit turns int64 into int32, wrapping 2**32 + 1 into slot 1: the host check
    refuses such values naming the field, and converts the rest to int32."""
    m = build_batch([Request.prefill(1, 3)], num_slots=N, num_spec=0, token_bucket=4, row_bucket=2).metadata
    bad = dataclasses.replace(m, state_indices=m.state_indices.astype(np.int64))
    bad.state_indices[0, 0] = 2 ** 32 + 1
    with pytest.raises(ValueError, match=r"batch.state_indices holds 4294967297, outside int32"):
        bad.host_checked()
    with pytest.raises(ValueError, match="batch.state_indices"):
        bad.to_device()
    ok = dataclasses.replace(m, query_start_loc=m.query_start_loc.astype(np.int64)).host_checked()
    assert ok.query_start_loc.dtype == np.int32 and ok.query_start_loc.tolist() == m.query_start_loc.tolist()
