"""The torch backend's verification room: which slots a commit or a decode makes
readable, and checking them against the expected values, linear in the KV
written (a mixin of :class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch  # first: without the torch extra, the missing module is torch

from ._kv_common import (
    _M32,
    _NO_TOKEN,
    _PROMPT,
    KV_CORRUPTION,
    _fmt,
    _same,
    _witness,
)
from ._kv_state import (
    _CHUNK_BYTES,
    _VERIFY,
    KVCorruption,
    _Gen,
    _Worker,
    _Xfer,
)


class _Verification:
    """Verification of what a commit or a decode reads.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    # -- verification --------------------------------------------------------

    def _owned(self, key: tuple[str, int], worker: str, blocks: Iterable[int]) -> bool:
        owner = self._owner
        for b in blocks:
            o = owner.get((worker, b))
            if not o or key not in o:
                return False
        return True

    @staticmethod
    def _prompt(g: _Gen) -> int:
        return g.prompt_len if g.prompt_len is not None else (g.processed_len or 0)

    def _expect(self, g: _Gen, worker: str, p0: int, p1: int) -> tuple[list[int], list[int]]:
        """Origin tag and token code expected at positions ``p0 .. p1-1`` of ``g`` on ``worker``."""
        prompt = self._prompt(g)
        orig = g.orig.get(worker)
        tag = g.tag
        if p1 <= prompt and not orig:
            return [tag], [_PROMPT] * (p1 - p0)
        tags, codes = [], []
        for p in range(p0, p1):
            if p < prompt:
                codes.append(_PROMPT)
                tags.append(orig.get(p, tag) if orig else tag)
            else:
                tok = g.exp_tok.get(p)
                codes.append(_NO_TOKEN if tok is None else (tok + 1) & _M32)
                tags.append(tag)
        if len(set(tags)) == 1:
            tags = tags[:1]
        return tags, codes

    def _check(
        self,
        w: _Worker,
        i: int,
        blk: int,
        s0: int,
        s1: int,
        exp: torch.Tensor,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        """Does part ``i`` of block ``blk``, slots ``s0..s1``, hold ``exp`` (float32)?"""
        L = self.layout
        if layers is None and not L.fp8:
            f = blk * L.block_size
            act = w.flats[i][f + s0 : f + s1]
            self.bytes_verified += act.numel() * act.element_size()
            return _same(act, exp)
        pool = w.pools[i]
        act = pool[blk][s0:s1] if layers is None else pool[blk, s0:s1, layers[0] : layers[1]]
        self.bytes_verified += act.numel() * act.element_size()
        if not L.fp8:
            return _same(act, exp)
        s = w.scales[i][blk] if L.scale == "per-block" else w.scales[i][0]
        if layers is not None:
            s = s[:, layers[0] : layers[1]]
        return bool(self._quant.close(self._quant.dequantize(act, s), exp, L.dtype, s).all())

    def _verify(
        self,
        g: _Gen,
        worker: str,
        table: Sequence[int],
        upto: int,
        line: int,
        what: str,
        witness: Iterable[int | None] = (),
        transfer: str | None = None,
        ticket: str | None = None,
    ) -> bool:
        """Check positions ``0..upto-1`` of ``g`` in ``table`` on ``worker``;
        report the first wrong element.  Only slots modified since ``g`` last
        verified them are checked again.  Returns True when all is right."""
        if upto <= 0:
            return True
        w = self._workers.get(worker)
        bs = self.layout.block_size
        need_blocks = -(-upto // bs)
        if w is None or len(table) < need_blocks:  # before any list of upto codes is made
            have = 0 if w is None else len(table)
            self._report_missing(g, worker, table, have * bs, what, line, witness, transfer, ticket)
            return False
        table = tuple(table)
        checked_get = g.checked.get
        stamp_get, mod_get, rs = w.stamp.get, w.mod.get, w.restart_stamp
        todo = []  # (table index, block, first slot, end slot, version)
        last = need_blocks - 1
        indices, imap = self._to_scan(g, w, table, need_blocks)
        for bi in indices:
            blk = table[bi]
            n = bs if bi < last else upto - bi * bs
            stamp = stamp_get(blk, 0)
            st = stamp if stamp >= rs else rs  # the block's version (see _version)
            rec = checked_get((worker, bi))
            lo = 0
            if rec is not None and rec[0] == blk:
                if rec[1] == st:
                    lo = rec[2]
                else:
                    m = mod_get(blk)
                    if m is not None and m[0] == rec[1] and stamp == st:
                        lo = min(rec[2], m[1])
            if lo < n:
                todo.append((bi, blk, lo, n, st))
        if not todo:
            g.fast[worker] = (table, upto, len(w.log), w.epoch, imap)
            return True
        self._worker(worker, need=[t[1] for t in todo])  # the pool covers what is read
        self._main_touch(worker)
        t_start = self._timer()
        ok = self._check_many(g, w, todo)
        self._sec[_VERIFY] += self._timer() - t_start
        if ok is not None:
            bi, blk, lo, n, _st = todo[ok]
            self._report_wrong(g, w, blk, bi, bi * bs + lo, n - lo, what, line, witness, transfer, ticket)
            return False
        checked = g.checked
        for bi, blk, _lo, n, st in todo:
            checked[(worker, bi)] = (blk, st, n)
        g.fast[worker] = (table, upto, len(w.log), w.epoch, imap)
        return True

    def _to_scan(self, g: _Gen, w: _Worker, table: tuple[int, ...], need: int) -> tuple[Iterable[int], dict]:
        """The table indices below ``need`` whose verified state may be stale,
        and the table's block -> indices map.  Since ``g``'s last verification
        on ``w`` through the same table (or a table it extends), only the
        indices of blocks modified since (``w.log``) and those at or past the
        last block it verified can be: the others hold the version ``g``
        verified.  Otherwise every index."""
        fs = g.fast.get(w.name)
        if fs is not None and fs[3] == w.epoch:
            old, upto, pos, _epoch, imap = fs
            same = table == old
            if same or (len(table) > len(old) and table[: len(old)] == old):
                if not same:
                    imap = {b: list(ix) for b, ix in imap.items()}
                    for i in range(len(old), len(table)):
                        imap.setdefault(table[i], []).append(i)
                log = w.log
                first = max(0, -(-upto // self.layout.block_size) - 1)
                if len(log) - pos < need:
                    idx = {i for b in set(log[pos:]) for i in imap.get(b, ()) if i < first}
                    return sorted(idx) + list(range(first, need)), imap
                return range(need), imap
        imap = {}
        for i, b in enumerate(table):
            imap.setdefault(b, []).append(i)
        return range(need), imap

    def _check_many(self, g: _Gen, w: _Worker, todo: list[tuple[int, int, int, int, int]]) -> int | None:
        """Check the slots of ``todo`` (see :meth:`_verify`); the index in
        ``todo`` of the first wrong one, or None."""
        bs = self.layout.block_size
        first, last = todo[0], todo[-1]
        if len(todo) == 1 and first[3] - first[2] == 1:
            bi, blk, lo, n, _st = first
            hit = w.lastw.pop(blk, None)
            if hit is not None:
                tags, codes = self._expect(g, w.name, bi * bs + lo, bi * bs + n)
                if hit[0] == lo and hit[1] == (tags[0], bi * bs + lo, codes[0]):
                    for i in range(len(w.parts)):
                        if not self._check(w, i, blk, lo, n, hit[2][i]):
                            return 0
                    return None
        p0, p1 = first[0] * bs + first[2], last[0] * bs + last[3]
        tags, codes = self._expect(g, w.name, p0, p1)
        rows = self._rows(tags, p0, codes)
        if self.layout.fp8:
            return self._check_each(w, todo, rows, p0)
        # runs of entries whose slots follow each other both in the pool and
        # in positions: [first entry, end entry, first pool slot, first position, slots]
        groups: list[list[int]] = []
        for k, (bi, blk, lo, n, _st) in enumerate(todo):
            f, p = blk * bs + lo, bi * bs + lo
            if groups:
                gr = groups[-1]
                if gr[2] + gr[4] == f and gr[3] + gr[4] == p:
                    gr[1] = k + 1
                    gr[4] += n - lo
                    continue
            groups.append([k, k + 1, f, p, n - lo])
        for i, (l0, l1, hs) in enumerate(w.parts):
            q = self._qpart(l0, l1, hs)
            flat = w.flats[i]  # [slots, layers, K/V, heads, D]
            chunk, scratch = self._scratch_for(flat)
            per = flat[0].numel() * flat.element_size()
            for k0, k1, f, p, n in groups:
                # expected values built in a reused buffer, compared with the pool's slots in place
                for c0 in range(0, n, chunk):
                    c = min(chunk, n - c0)
                    e = p + c0 - p0
                    exp = torch.add(q, rows[e : e + c], out=scratch[:c])
                    self.bytes_verified += c * per
                    if not _same(flat[f + c0 : f + c0 + c], exp):
                        bad = self._check_each(w, todo[k0:k1], rows, p0, only=i)
                        return k0 + (bad or 0)
        return None

    def _check_each(
        self,
        w: _Worker,
        todo: list[tuple[int, int, int, int, int]],
        rows: torch.Tensor,
        p0: int,
        only: int | None = None,
    ) -> int | None:
        """Check the entries of ``todo`` one by one (``rows``: the
        position-dependent values from position ``p0``), on every part or
        part ``only``: the index of the first wrong one (None if all hold)."""
        bs = self.layout.block_size
        for i, (l0, l1, hs) in enumerate(w.parts):
            if only is not None and i != only:
                continue
            q = self._qpart(l0, l1, hs)
            for k, (bi, blk, lo, n, _st) in enumerate(todo):
                e0 = bi * bs + lo - p0
                if not self._check(w, i, blk, lo, n, q + rows[e0 : e0 + n - lo]):
                    return k
        return None

    def _scratch_for(self, flat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(slots per chunk, a reused buffer of that many slots shaped like
        ``flat``'s): expected values are built a chunk at a time (a few MiB,
        so they are compared while still in cache, and never faulted in anew)."""
        key = (tuple(flat.shape[1:]), flat.dtype)
        buf = self._scratch.get(key)
        if buf is None:
            per = flat[0].numel() * flat.element_size()
            rows = max(1, _CHUNK_BYTES // per)
            buf = self._scratch[key] = torch.empty((rows,) + key[0], dtype=flat.dtype, device=flat.device)
            self.memory += rows * per
        return buf.shape[0], buf

    def _verify_items(
        self,
        g: _Gen,
        worker: str,
        items: list[tuple[int, int, int, int]],
        layers: tuple[int, int] | None,
        line: int,
        what: str,
        witness: Iterable[int | None],
        transfer: str | None,
        ticket: str | None,
    ) -> bool:
        """:meth:`_verify_slots` of each item (block, first position, slots,
        first slot), in order, batched: the positions of consecutive items
        follow each other, so one row build serves them all, and items whose
        slots also follow each other in the pool are compared in one go."""
        w = self._workers.get(worker)
        if w is None or not items:
            return True
        contiguous = all(items[k][1] == items[k - 1][1] + items[k - 1][2] for k in range(1, len(items)))
        if contiguous and not self.layout.fp8:
            self._worker(worker, need=[it[0] for it in items])
            self._main_touch(worker)
            t_start = self._timer()
            ok = self._same_items(g, w, items, layers)
            self._sec[_VERIFY] += self._timer() - t_start
            if ok:
                return True
        for blk, p, n, s0 in items:  # one by one: the first wrong item is reported
            if not self._verify_slots(
                g, worker, blk, p - s0, s0, s0 + n, layers, line, what, witness, transfer, ticket
            ):
                return False
        return True

    def _same_items(
        self, g: _Gen, w: _Worker, items: list[tuple[int, int, int, int]], layers: tuple[int, int] | None
    ) -> bool:
        """Do the items (see :meth:`_verify_items`) hold what ``g`` expects in ``layers``?"""
        bs = self.layout.block_size
        P0 = items[0][1]
        tags, codes = self._expect(g, w.name, P0, items[-1][1] + items[-1][2])
        rows = self._rows(tags, P0, codes)
        runs: list[list[int]] = []  # [first pool slot, first position, slots]
        for blk, p, n, s0 in items:
            f = blk * bs + s0
            if runs and runs[-1][0] + runs[-1][2] == f:
                runs[-1][2] += n
            else:
                runs.append([f, p, n])
        for i, (l0, l1, hs) in enumerate(w.parts):
            a, b = (l0, l1) if layers is None else (max(l0, layers[0]), min(l1, layers[1]))
            if a >= b:
                continue
            q = self._qpart(a, b, hs)
            flat = w.flats[i] if (a, b) == (l0, l1) else w.flats[i][:, a - l0 : b - l0]
            chunk, scratch = self._scratch_for(flat)
            per = flat[0].numel() * flat.element_size()
            for f, p, n in runs:
                for c0 in range(0, n, chunk):
                    c = min(chunk, n - c0)
                    exp = torch.add(q, rows[p - P0 + c0 : p - P0 + c0 + c], out=scratch[:c])
                    self.bytes_verified += c * per
                    if not _same(flat[f + c0 : f + c0 + c], exp):
                        return False
        return True

    def _verify_slots(
        self,
        g: _Gen,
        worker: str,
        blk: int,
        p0: int,
        s0: int,
        s1: int,
        layers: tuple[int, int] | None,
        line: int,
        what: str,
        witness: Iterable[int | None],
        transfer: str | None,
        ticket: str | None,
    ) -> bool:
        """Check slots ``s0..s1`` of ``blk`` (positions ``p0+s0 ..``), ``layers`` only."""
        w = self._workers.get(worker)
        if w is None or s0 >= s1:
            return True
        self._worker(worker, need=[blk])
        self._main_touch(worker)
        t_start = self._timer()
        tags, codes = self._expect(g, worker, p0 + s0, p0 + s1)
        rows = self._rows(tags, p0 + s0, codes)
        for i, (l0, l1, hs) in enumerate(w.parts):
            a, b = (l0, l1) if layers is None else (max(l0, layers[0]), min(l1, layers[1]))
            if a >= b:
                continue
            exp = self._qpart(a, b, hs) + rows
            ok = self._check(w, i, blk, s0, s1, exp, (a - l0, b - l0))
            self._sec[_VERIFY] += self._timer() - t_start
            t_start = self._timer()
            if not ok:
                self._report_wrong(
                    g,
                    w,
                    blk,
                    (p0 + s0) // self.layout.block_size,
                    p0 + s0,
                    s1 - s0,
                    what,
                    line,
                    witness,
                    transfer,
                    ticket,
                )
                return False
        return True

    def _final_check(self, g: _Gen, line: int) -> None:
        if g.last_decode is None:
            return
        worker, table, pos, dline = g.last_decode
        g.last_decode = None
        for b in table:
            if self._final.get((worker, b)) == g.key:
                del self._final[(worker, b)]
        self._verify(
            g,
            worker,
            table,
            pos + 1,
            line,
            f"final check (after the last decode at line {dline})",
            [dline, g.prefill_line],
        )

    def _write_probe(self, worker: str, b: int, line: int) -> None:
        w = self._worker(worker, "decode", [b])
        if w is None:
            return
        bs = self.layout.block_size
        self._write_positions(w, [b], [self._probe_tag], 0, [_PROMPT] * bs, line)

    def _verify_probe(self, worker: str, b: int, t: _Xfer, line: int) -> None:
        w = self._workers[worker]
        owners = self._owner.get((worker, b))
        bs = self.layout.block_size
        rows = self._rows([self._probe_tag], 0, [_PROMPT] * bs)
        self._main_touch(worker)
        for i, (l0, l1, hs) in enumerate(w.parts):
            if self._check(w, i, b, 0, bs, self._qpart(l0, l1, hs) + rows):
                continue
            who = "free" if not owners else f"now owned by {_fmt(owners[0])}"
            self._emit(
                ("probe", t.tid),
                KVCorruption(
                    KV_CORRUPTION,
                    line,
                    f"transfer {t.tid!r} of {_fmt(t.key)} writes into block {b} on {worker!r}, which was "
                    f"freed or re-allocated while the write was in flight ({who}): the write, landing at "
                    f"the end of the history (the latest it can), overwrote the KV the block held then "
                    f"(a probe standing for its next owner's KV)",
                    _witness([t.line, w.last_write.get(b)], line),
                    request=t.key[0],
                    gen=t.key[1],
                    worker=worker,
                    block=b,
                    rank=i,
                    transfer=t.tid,
                    ticket=t.ticket,
                    found={"request": t.key[0], "gen": t.key[1]},
                ),
            )
            return

    def _verify_transfer(self, t: _Xfer, line: int, what: str) -> None:
        """Does ``t``'s target hold its generation's prompt KV in the layers and
        slots it moved (as the commit that may follow would read)?"""
        g = self._gens.get(t.key)
        if g is None or g.prefill_line is None or t.lost:
            return
        if t.src not in g.prefill or not self._owned(t.key, t.dst, t.dst_blocks):
            return
        if not t.moves:
            self._plan(t)
        prompt = self._prompt(g)
        for _i, _sb, db, p0, s0, s1 in t.moves:
            s1 = min(s1, prompt - p0)
            if s0 >= s1:
                continue
            if not self._verify_slots(
                g,
                t.dst,
                db,
                p0,
                s0,
                s1,
                t.layers,
                line,
                f"{what} {t.tid!r}",
                [t.line, g.prefill_line],
                t.tid,
                t.ticket,
            ):
                return
