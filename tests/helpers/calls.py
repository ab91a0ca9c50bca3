"""One feed call over whole rows (``pick``) and the partial calls of a row split with their
combine (``split``), shared by the logprobs tests and the simt tests that compare backends; one
sampled call (``sample``) and the same on the host sampler's two paths (``both_paths``), shared by
the sampling tests."""

import numpy as np

import metrale_feed as mf
from metrale_feed import _core


def pick(dev, logits, masks=None, bitmask=None, params=None, with_logprobs=True, row_stride=None):
    """argmax_to_feed (params None) or sample_to_feed over whole rows: (ids, logprobs or None)."""
    rows = logits.shape[0]
    vocab = logits.shape[1] if row_stride is None else row_stride[1]
    buf, cells = dev.upload(logits), mf.DeviceBuffer(rows * 4)
    held = [buf, cells]
    if bitmask is not None:
        bitmask = dev.upload(bitmask)
        held.append(bitmask)
    lp_dev = mf.DeviceBuffer(rows * 4) if with_logprobs else None
    lp = np.full(rows, 7.0, np.float32) if with_logprobs else None
    ids = np.zeros(rows, np.uint32)
    kw = dict(masks=masks, bitmask=bitmask, rows=rows, vocab=vocab, dtype=np.dtype(logits.dtype).name,
              row_stride=None if row_stride is None else row_stride[0], logprobs=lp_dev, logprobs_dst=lp)
    with mf.Event() as done:
        if params is None:
            mf.argmax_to_feed(buf, kw.pop("masks"), cells, ids, done, **kw)
        else:
            mf.sample_to_feed(buf, params, cells, ids, done, **kw)
        done.synchronize()
    for b in held + ([lp_dev] if lp_dev else []):
        b.close()
    return ids, lp


def upload_slice(dev, logits, lo, hi, pad, held):
    """Columns [lo, hi) of every row on the device, each row padded to ``hi - lo + pad`` columns
    (a padded row stride), kept in ``held``; None for an empty slice."""
    if hi == lo:
        return None
    part = np.zeros((logits.shape[0], hi - lo + pad), logits.dtype)
    part[:, : hi - lo] = logits[:, lo:hi]
    held.append(dev.upload(part))
    return held[-1]


def split(dev, logits, offsets, masks=None, bitmask=None, params=None, pad=0, call=11,
          tamper=None, logprobs=True, drafts=None, k=None):
    """The partial calls over the slices [offsets[w], offsets[w+1]) and their combine: (ids,
    logprobs or None, fault word). ``pad`` widens each slice's rows (a padded row stride);
    ``tamper(w)`` returns overrides for slice w's call; ``logprobs`` is asked of every partial call
    and of the combine. ``drafts`` (uint32 ``rows / (k + 1) * k``) and ``k``: a greedy verify's
    combine, whose ids are verify_to_feed's ``rows / (k + 1) * (k + 2)`` cell words."""
    rows, vocab = logits.shape
    world = len(offsets) - 1
    block = _core._partial_bytes(rows)
    words = rows if k is None else rows // (k + 1) * (k + 2)
    parts, cells, lp_dev = mf.DeviceBuffer(block * world), mf.DeviceBuffer(words * 4), mf.DeviceBuffer(rows * 4)
    held = [parts, cells, lp_dev]
    verify = {}
    if k is not None:
        verify = dict(drafts=dev.upload(np.ascontiguousarray(drafts, np.uint32)), k=k)
        held.append(verify["drafts"])
    if bitmask is not None:
        bitmask = dev.upload(bitmask)
        held.append(bitmask)
    dtype = np.dtype(logits.dtype).name
    for w in range(world):
        lo, hi = offsets[w], offsets[w + 1]
        sl = upload_slice(dev, logits, lo, hi, pad, held)
        kw = dict(rows=rows, start=lo, stop=hi, vocab=vocab, dtype=dtype, call=call, bitmask=bitmask,
                  row_stride=hi - lo + pad if pad else None, logprobs=logprobs)
        if tamper:
            kw.update(tamper(w))
        if params is None:
            _core._argmax_partial(sl, masks, parts.ptr + w * block, **kw)
        else:
            _core._sample_partial(sl, params, parts.ptr + w * block, masks=masks, **kw)
    ids, lp = np.zeros(words, np.uint32), np.full(rows, 7.0, np.float32) if logprobs else None
    fault = mf.PinnedBuffer(4)
    with mf.Event() as done:
        _core._combine_partials(parts, world, cells, ids, done, rows=rows, vocab=vocab, call=call,
                                fault_dst=fault, params=params, logprobs=lp_dev if logprobs else None,
                                logprobs_dst=lp, **verify)
        done.synchronize()
    for b in held:
        b.close()
    return ids, lp, fault


TOP_RECORD = np.dtype([("id", "<u4"), ("logprob", "<f4")])


def split_top(dev, logits, offsets, n, ids=None, call=5, pad=0, tamper=None):
    """Each slice's top-logprobs block (``_top_partial``) and their combine (``_top_combine``):
    (records ``(rows, n)``, chosen logprobs or None, fault word). ``ids``: global ids asked of
    every slice; ``tamper(w)`` returns overrides for slice w's call (``rows``, ``n``, ``call``)."""
    rows, vocab = logits.shape
    world = len(offsets) - 1
    block = _core._top_block_bytes(rows, n)
    parts, out = mf.DeviceBuffer(block * world), mf.DeviceBuffer(max(1, rows * n * 8))
    held = [parts, out]
    ids_dev = chosen = None
    if ids is not None:
        ids_dev, chosen = dev.upload(np.ascontiguousarray(ids, np.uint32)), mf.DeviceBuffer(rows * 4)
        held += [ids_dev, chosen]
    dtype = np.dtype(logits.dtype).name
    for w in range(world):
        lo, hi = offsets[w], offsets[w + 1]
        sl = upload_slice(dev, logits, lo, hi, pad, held)
        kw = dict(n=n, start=lo, vocab_total=vocab, call=call, rows=rows, vocab=hi - lo, dtype=dtype,
                  row_stride=hi - lo + pad if pad else None, ids=ids_dev)
        if tamper:
            kw.update(tamper(w))
        _core._top_partial(sl, parts.ptr + w * block, **kw)
    fault = mf.PinnedBuffer(4)
    with mf.Event() as done:
        _core._top_combine(parts, world, out if n else None, rows=rows, n=n, vocab=vocab, call=call,
                           slice_stride=block // 16, fault_dst=fault, chosen=chosen, event=done)
        done.synchronize()
    recs = dev.download(out, TOP_RECORD, rows * n).reshape(rows, n)
    lp = dev.download(chosen, np.float32, rows) if chosen is not None else None
    for b in held:
        b.close()
    return recs, lp, fault


def split_filtered(dev, logits, offsets, params, call=21, states=None, skip=True, rounds=None,
                   device=False, slice_params=None, drafts=None, k=None, masks=None, bitmask=None):
    """The split filters' protocol in one process (tp/select_rounds.py's, rank by rank): each
    slice's stages into its own blocks, every exchange as copies of all the slices' blocks (zeros
    once a slice's decision refused the call, as the shard's exchange does), each slice's
    decisions (``_select_decide``) on its own state, then the combine of the race winners (every
    slice's combine gives the same ids; slice 0's is returned, with the decisions' fault words of
    every slice). ``states``: a list that gets each slice's final ``mf_select_row`` and
    ``mf_select_plan`` bytes, what the decisions wrote. ``skip=False``: fixed rounds' protocol, where
    every exchange runs whatever the decisions found and the combine takes the first decision's
    fault word (``refused``). ``rounds``: a ``FilterRounds`` (fixed rounds: their blocks, and the
    TOP decision's check of the rows). ``device``: the stages and the combine read each slice's
    params from its device copy, as a captured call does. ``slice_params``: slice w's params,
    ``slice_params[w]`` (default ``params`` on every slice; the combine takes slice 0's).
    ``drafts`` (host uint32, ``rows / (k + 1) * k`` ids) and ``k``: a sampled verify, the logits
    its ``rows`` logit rows and ``params`` theirs (position j's at position + j); returns its cells
    (``verify_to_feed``'s layout) instead of one id a row, after checking that every slice's combine
    (each with its own state) writes the same. ``masks`` (host, a pair a row) and ``bitmask`` (host
    words of the whole rows): the rows' rule, as the unsharded call takes them."""
    from types import SimpleNamespace

    from metrale_feed.tp.select_rounds import LIST_CAP, ROUNDS, FilteredCall

    rows, vocab = logits.shape
    world = len(offsets) - 1
    block = _core._partial_bytes(rows)
    dtype = np.dtype(logits.dtype).name
    own = slice_params or [params] * world
    calls = [FilteredCall(SimpleNamespace(_block=block, world=world, rank=w, vocab=vocab, _fault=None,
                                          max_rows=rows), own[w], rows, call, rounds) for w in range(world)]
    held = []
    slices = [upload_slice(dev, logits, offsets[w], offsets[w + 1], 0, held) for w in range(world)]
    verify = {} if drafts is None else dict(drafts=dev.upload(np.asarray(drafts, np.uint32)), k=k)
    held.extend([verify["drafts"]] if verify else [])
    rule = {} if masks is None else dict(masks=np.ascontiguousarray(masks, np.uint32))
    if bitmask is not None:
        rule["bitmask"] = dev.upload(np.ascontiguousarray(bitmask, np.int32))
        held.append(rule["bitmask"])

    def stage(name, out):
        for w, c in enumerate(calls):
            kw = dict(start=offsets[w], stop=offsets[w + 1], vocab=vocab, dtype=dtype, call=call, rows=rows,
                      id_list=c.id_list, list_cap=LIST_CAP)
            if c.cap and name in ("cands", "race"):
                kw.update(cands_cap=c.cap)
                if name == "race":
                    kw.update(cands=c.cgathered, cands_world=world, cands_stride=c.cblock)
            if verify and name in ("top", "race"):
                kw.update(verify)
            kw.update(rule)
            _core._select_partial(slices[w], c.params_dev if device else own[w], getattr(c, out), c.state_buf,
                                  name, **kw)

    def exchange(src, dst, size):
        for c in calls:
            if skip and dev.download(c.decided, np.uint32, 1)[0]:  # refused: no collective, zeroed (_gather)
                dev.write(getattr(c, dst), np.zeros(world * size, np.uint8))
                continue
            for w, peer in enumerate(calls):
                mf.copy_d2d_async(getattr(c, dst).ptr + w * size, getattr(peer, src), size)

    first = calls[0]
    for c in calls:
        mf.copy_h2d_async(c.params_dev, c.params)
    stage("top", "top")
    exchange("top", "gathered", block)
    for c in calls:
        _core._select_decide(*c.world_args(c.gathered, block), step="top", vocab=vocab, call=call,
                             next=c.selects[0] if c.selects else None,
                             rounds=None if rounds is None else (rounds.top_k, rounds.top_p))
    if first.cap:
        stage("cands", "cands")
        exchange("cands", "cgathered", first.cblock)
    for i, sel in enumerate(first.selects):
        for j in range(ROUNDS):
            stage("hist", "hist")
            exchange("hist", "hgathered", first.hblock)
            after = first.selects[i + 1] if j == ROUNDS - 1 and i + 1 < len(first.selects) else None
            for c in calls:
                _core._select_decide(*c.world_args(c.hgathered, c.hblock), step="round", sel=sel, round=j,
                                     next=after)
    stage("race", "top")
    exchange("top", "gathered", block)
    words = rows // (k + 1) * (k + 2) if verify else rows
    cells, ids, fault = mf.DeviceBuffer(words * 4), np.zeros(words, np.uint32), mf.PinnedBuffer(4)
    # A verify's combine reads each slice's own state (the draft's bits, zmax): every slice's.
    for c in calls if verify else [first]:
        out = np.zeros(words, np.uint32)
        with mf.Event() as done:
            if verify:  # the logit rows' params from the device: a sampled verify's combine reads them there
                more = dict(params=c.params_dev, select=c.state_buf, **verify)
            else:
                more = dict(params=first.params_dev if device else params)
            _core._combine_partials(c.gathered, world, cells, out, done, rows=rows, vocab=vocab, call=call,
                                    fault_dst=fault, filtered=True, refused=None if skip else c.decided, **more)
            done.synchronize()
        if c is first:
            ids[:] = out
        assert out.tolist() == ids.tolist(), "the slices' combines differ"
    words = [int(dev.download(c.decided, np.uint32, 1)[0]) for c in calls]
    if states is not None:
        states.extend(dev.download(c.state_buf).tobytes() + dev.download(c.plan).tobytes() for c in calls)
    for b in held + [cells] + calls:
        b.close()
    return ids, fault, words


def sample(dev, logits, params, masks=None, bitmask=None, device_params=False):
    """sample_to_feed over the whole rows of ``logits`` (uploaded; ``bitmask`` and, with
    ``device_params``, ``params`` too), waited for: the drawn ids."""
    rows, vocab = logits.shape
    buf, cells = dev.upload(logits), mf.DeviceBuffer(rows * 4)
    held = [buf, cells]
    if bitmask is not None:
        bitmask = dev.upload(bitmask)
        held.append(bitmask)
    if device_params:
        params = dev.upload(params)
        held.append(params)
    dst = np.zeros(rows, np.uint32)
    with mf.Event() as done:
        mf.sample_to_feed(buf, params, cells, dst, done, masks=masks, bitmask=bitmask, rows=rows,
                          vocab=vocab, dtype=np.dtype(logits.dtype).name)
        done.synchronize()
    for b in held:
        b.close()
    return dst


def both_paths(dev, logits, params, masks=None, bitmask=None):
    """``sample`` on the host sampler's vector path, then on its portable path (the vector path
    back on afterwards): (vector ids, portable ids)."""
    got = {}
    for portable in (False, True):
        mf.host_argmax_path(portable)
        try:
            got[portable] = sample(dev, logits, params, masks, bitmask)
        finally:
            mf.host_argmax_path(False)
    return got[False], got[True]
