"""Pure-torch attention references: the accuracy reference (run them on float64 inputs) and the CPU path.

Batch-invariant by construction, like every `*_ref`: each sequence is attended on its own, every sum is
`fold_sum` (QK^T over head_dim, the softmax denominator and PV over keys), everything else elementwise.
Key j of a sequence always sits at index j of the reduced axis and a key a query may not see contributes
an exact 0, so a query's bits do not depend on how many keys follow it (fold_sum ignores trailing zeros)
nor on how its sequence was chunked into steps. Not bitwise equal to the Triton kernel (another order).
"""

from __future__ import annotations

import math

import torch

from detinfer.kernels._fold import fold_sum

# Elements of the largest broadcast product held at once (queries are processed in chunks of rows;
# rows are independent, so the chunking does not change any bits).
_CHUNK_ELEMS = 1 << 24


def check_lse_out(op: str, lse_out, q: torch.Tensor) -> None:
    """lse_out (paged attention's optional row log-sum-exp buffer): None or a contiguous fp32 [T, Hq] tensor
    on q's device."""
    if lse_out is None:
        return
    shape = (q.shape[0], q.shape[1])
    ok = isinstance(lse_out, torch.Tensor) and lse_out.dtype == torch.float32 and tuple(lse_out.shape) == shape
    if not (ok and lse_out.device == q.device and lse_out.is_contiguous()):
        got = (f"{lse_out.dtype} {tuple(lse_out.shape)} on {lse_out.device}"
               f"{'' if lse_out.is_contiguous() else ', not contiguous'}") \
            if isinstance(lse_out, torch.Tensor) else type(lse_out).__name__
        raise ValueError(f"{op}: lse_out must be a contiguous torch.float32 tensor of shape {shape} on "
                         f"{q.device}, got {got}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
    """One sequence: q [n, Hq, D] at absolute positions q_pos [n]; k, v [L, Hkv, D] its keys 0..L-1.
    Query i sees keys j <= q_pos[i] (and j > q_pos[i] - sliding_window). Returns [n, Hq, D] in q.dtype;
    a query that sees no key returns 0."""
    acc = _acc_dtype(q.dtype)
    n, hq, d = q.shape
    group = hq // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1).permute(1, 0, 2)  # [Hq, L, D]
    vf = v.to(acc).repeat_interleave(group, dim=1).permute(1, 0, 2)  # [Hq, L, D]
    keys = torch.arange(k.shape[0], device=q.device)
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    rows = max(1, _CHUNK_ELEMS // max(1, hq * k.shape[0] * d))
    for r0 in range(0, n, rows):
        qf = q[r0:r0 + rows].to(acc)  # [r, Hq, D]
        pos = q_pos[r0:r0 + rows].to(keys.device)[:, None]
        visible = keys[None, :] <= pos
        if sliding_window is not None:
            visible &= keys[None, :] > pos - sliding_window
        s = fold_sum(qf[:, :, None, :] * kf[None], -1) * scale  # [r, Hq, L]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)  # masked keys: exp(-inf) = 0 exactly
        l = fold_sum(p, -1)  # [r, Hq]
        o = fold_sum(p[..., None] * vf[None], -2)  # [r, Hq, D]
        safe_l = torch.where(l == 0, torch.ones_like(l), l)
        out[r0:r0 + rows] = torch.where(l[..., None] == 0, 0.0, o / safe_l[..., None]).to(q.dtype)
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor, cu_q_lens: torch.Tensor,
                        scale: float, *, sliding_window: int | None = None, max_q_len: int | None = None,
                        max_kv_len: int | None = None, validate: bool | None = None,
                        lse_out: torch.Tensor | None = None, **_ignored) -> torch.Tensor:
    """`paged_attention` in pure torch (any float dtype, any device).

    Same signature as `paged_attention`; the hints and split/schedule keywords are accepted and ignored.
    lse_out gets the rows' log-sum-exps as the kernel defines them (log2 units of the scaled scores),
    computed in the accumulation dtype (fp64 for fp64 inputs: the accuracy reference).
    Metadata values are always checked (the function reads them on the host anyway).

    The step's single-query sequences (decode) are attended together (a host loop per sequence made a
    decode step of a 20-sequence batch cost hundreds of tiny ops per layer): every such row gathers its own
    sequence's keys, padded with zeros to the longest of them and masked. Same bits as attending each
    sequence alone (`attend_ref`): a masked key's probability is an exact 0, its padded value an exact 0,
    and `fold_sum` ignores trailing zeros, so the padding length never reaches a result. Multi-query
    sequences (prefill chunks) go one at a time, their rows sharing one copy of the keys.
    """
    from detinfer.kernels._launch import check_step_metadata

    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention_ref: need q [T, Hq, D] and k_cache, v_cache [num_blocks, "
                         f"block_size, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged_attention_ref: q heads/dim {tuple(q.shape[1:])} do not fit k/v heads/dim "
                         f"{tuple(k_cache.shape[2:])} (Hq must be a multiple of Hkv, head_dims equal)")
    check_step_metadata(cu_q_lens, kv_lens, block_tables, block_size=k_cache.shape[1],
                        num_blocks=k_cache.shape[0], num_tokens=q.shape[0], max_kv_len=max_kv_len,
                        op="paged_attention_ref")
    check_lse_out("paged_attention_ref", lse_out, q)
    out = torch.zeros_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cu, kvl = cu_q_lens.tolist(), kv_lens.tolist()
    singles = [s for s in range(len(kvl)) if cu[s + 1] - cu[s] == 1]
    if singles:  # decode rows: one batch, keys padded to the longest of them
        keys, values = _gather_padded(k_cache, v_cache, block_tables[singles], [kvl[s] for s in singles])
        rows = torch.tensor([cu[s] for s in singles], device=q.device)
        pos = torch.tensor([kvl[s] - 1 for s in singles], device=q.device)
        out[rows], lse[rows] = _attend_chunked(q[rows], keys, values, pos, scale, sliding_window)
    for s, kv_len in enumerate(kvl):  # prefill chunks: one sequence at a time, its keys shared by its rows
        q0, q1 = cu[s], cu[s + 1]
        if q1 - q0 > 1:
            keys, values = _gather_padded(k_cache, v_cache, block_tables[s:s + 1], [kv_len])
            pos = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)
            out[q0:q1], lse[q0:q1] = _attend_chunked(q[q0:q1], keys, values, pos, scale, sliding_window)
    if lse_out is not None:
        lse_out[:cu[-1]] = lse[:cu[-1]]
    return out


def _attend_chunked(q, keys, values, pos, scale, sliding_window):
    """`_attend_rows` over memory-bounded chunks of rows (rows are independent: chunking changes no bit).
    keys / values: [r, L, Hkv, D] (one sequence per row) or [1, L, Hkv, D] (one shared by every row).
    -> (out, lse [n, Hq] fp32)."""
    n, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((n, hq), dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMS // max(1, hq * keys.shape[1] * d))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        k, v = (keys, values) if keys.shape[0] == 1 else (keys[r0:r1], values[r0:r1])
        out[r0:r1], lse[r0:r1] = _attend_rows(q[r0:r1], k, v, pos[r0:r1], scale, sliding_window)
    return out, lse


def _gather_padded(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, kvl: list[int]):
    """Each sequence's keys and values in position order, [S, Lmax, Hkv, D], exact zeros past its length."""
    bs = k_cache.shape[1]
    lmax = max(kvl)
    pos = torch.arange(lmax, device=k_cache.device)
    tables = block_tables.to(device=k_cache.device, dtype=torch.int64)
    cols = (pos // bs).clamp(max=max(tables.shape[1] - 1, 0))
    slots = tables[:, cols] * bs + pos % bs  # [S, Lmax]; entries past a sequence's length are masked below
    valid = pos[None, :] < torch.tensor(kvl, device=k_cache.device)[:, None]
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    zero = valid[:, :, None, None]
    return (torch.where(zero, flat_k[slots], torch.zeros((), dtype=k_cache.dtype, device=k_cache.device)),
            torch.where(zero, flat_v[slots], torch.zeros((), dtype=v_cache.dtype, device=v_cache.device)))


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                 sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows q [r, Hq, D] at positions q_pos [r], each with its own keys/values k, v [r, L, Hkv, D]
    (zeros past its sequence's end), or all with the same ones ([1, L, Hkv, D]). The arithmetic of
    `attend_ref`, op for op. -> (out, lse): lse [r, Hq] = log2(sum_j 2^(scale * log2(e) * q.k_j)), as the
    kernel stores it (-inf for a row that sees no key)."""
    acc = _acc_dtype(q.dtype)
    r, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    kf = k.to(acc).permute(0, 2, 1, 3)[:, :, None]  # [r, Hkv, 1, L, D]
    vf = v.to(acc).permute(0, 2, 1, 3)[:, :, None]  # [r, Hkv, 1, L, D]
    qf = q.to(acc).view(r, hkv, group, 1, d)
    keys = torch.arange(k.shape[1], device=q.device)
    pos = q_pos[:, None]
    visible = keys[None, :] <= pos
    if sliding_window is not None:
        visible &= keys[None, :] > pos - sliding_window
    s = fold_sum(qf * kf, -1).reshape(r, hq, -1) * scale  # [r, Hq, L]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)  # masked keys: exp(-inf) = 0 exactly
    l = fold_sum(p, -1)  # [r, Hq]
    o = fold_sum(p.view(r, hkv, group, -1)[..., None] * vf, -2).reshape(r, hq, d)  # [r, Hq, D]
    safe_l = torch.where(l == 0, torch.ones_like(l), l)
    lse = torch.where(l == 0, float("-inf"), (m[..., 0] + torch.log(safe_l)) * (1 / math.log(2)))
    return torch.where(l[..., None] == 0, 0.0, o / safe_l[..., None]).to(q.dtype), lse.float()


def attention_contiguous_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: torch.Tensor,
                             scale: float, *, sliding_window: int | None = None, **_ignored) -> torch.Tensor:
    """`attention_contiguous` in pure torch: q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D], key_start [B]."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] \
            or k.shape[2] < q.shape[2]:
        raise ValueError("attention_contiguous_ref: need q [B, Hq, Lq, D], k, v [B, Hkv, Lk >= Lq, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    lq, lk = q.shape[2], k.shape[2]
    out = torch.zeros_like(q)
    for b, start in enumerate(key_start.tolist()):
        if not 0 <= start <= lk:
            raise ValueError(f"attention_contiguous_ref: key_start[{b}] = {start} outside [0, {lk}]")
        pos = torch.arange(lk - lq, lk, device=q.device) - start
        o = attend_ref(q[b].transpose(0, 1), k[b, :, start:].transpose(0, 1), v[b, :, start:].transpose(0, 1),
                       pos, scale, sliding_window)
        out[b] = o.transpose(0, 1)
    return out
