"""The torch backend's event room: one handler per event kind (the dispatch
table in :mod:`._torch` maps each kind to one; a mixin of
:class:`~pdproto.backends._torch.TorchBackend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch  # first: without the torch extra, the missing module is torch

from ..spec import (
    Alloc,
    Cancel,
    Commit,
    Decode,
    Fail,
    Finish,
    Free,
    PrefillDone,
    PrefillStart,
    Reserve,
    Restart,
    Submit,
    TransferAbort,
    TransferFailed,
    TransferReadDone,
    TransferStart,
    TransferWriteDone,
)
from ._kv_common import (
    _M32,
    _PROMPT,
    _bytes,
)
from ._kv_state import (
    _STASH_BATCH,
    _Gen,
    _Worker,
    _Xfer,
)
from ._transport import CopyTransport, Transfer


class _Handlers:
    """One handler per event kind.

    The state it uses is set up by ``TorchBackend.__init__``.
    """

    # -- one handler per event kind -----------------------------------------

    def _on_submit(self, ev: Submit, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        g.prompt_len = ev.prompt_len

    def _allocate(self, key: tuple[str, int], worker: str, blocks: Sequence[int], role: str) -> None:
        self._worker(worker, role, blocks)
        for b in blocks:
            self._owner[(worker, b)] = [key]
        self._alloc.setdefault(key, {}).setdefault(worker, []).extend(blocks)

    def _on_reserve(self, ev: Reserve, line: int) -> None:
        key = (ev.request, ev.gen)
        self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "decode")
        self._tickets[ev.ticket] = (key, ev.worker, ev.blocks)

    def _on_prefill_start(self, ev: PrefillStart, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "prefill")
        g.prefill[ev.worker] = ev.blocks

    def _on_prefill_done(self, ev: PrefillDone, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        g.processed_len = ev.processed_len
        g.first_token = ev.first_token
        if g.prompt_len is None:
            g.prompt_len = ev.processed_len
        if not self._recompute:  # recompute (vLLM's convention): P's sampled token is discarded
            self._expect_token(g, g.prompt_len, ev.first_token)
        g.prefill_line = line
        shared = g.shared.get(ev.worker)
        table = self._table(g, ev.worker, g.prefill.get(ev.worker, ()))
        w = self._worker(ev.worker, "prefill")
        if not table or w is None or (ev.worker not in g.prefill and not shared):
            return
        # a prefix-cache hit computes the positions past its shared prefix only
        start = shared[1] if shared else 0
        # positions past the table are dropped: never make more codes than it holds
        n = max(0, min(ev.processed_len, len(table) * self.layout.block_size - start))
        if n:
            self._write_positions(w, table, [g.tag], start, [_PROMPT] * n, line)
            o = g.orig.get(ev.worker)
            if o:
                for p in range(start, start + n):
                    if o.pop(p, None) is not None:
                        g.invalidate(ev.worker, p // self.layout.block_size)

    def _expect_token(self, g: _Gen, position: int, token: int) -> None:
        old = g.exp_tok.get(position)
        g.exp_tok[position] = token
        if old is not None and old != token:
            g.invalidate(None, position // self.layout.block_size)

    def _on_alloc(self, ev: Alloc, line: int) -> None:
        key = (ev.request, ev.gen)
        self._gen(key)
        self._allocate(key, ev.worker, ev.blocks, "decode")

    def _on_share(self, ev: Any, line: int) -> None:
        """A prefix-cache hit: take a reference on the blocks; the origins of
        the KV they hold for positions [old tokens, tokens) become expected."""
        key = (ev.request, ev.gen)
        g = self._gen(key)
        w = self._worker(ev.worker, "prefill", ev.blocks)
        old_blocks, old_tokens = g.shared.get(ev.worker, ((), 0))
        blocks = tuple(old_blocks) + tuple(ev.blocks)
        g.shared[ev.worker] = (blocks, ev.tokens)
        for b in ev.blocks:
            owners = self._owner.setdefault((ev.worker, b), [])
            if not owners and w is not None:
                self._revive(w, b)
            if key not in owners:
                owners.append(key)
        if w is None:
            return
        bs = self.layout.block_size
        o = g.orig.setdefault(ev.worker, {})
        for p in range(old_tokens, min(ev.tokens, len(blocks) * bs)):
            blk = blocks[p // bs]
            slots = w.origin.get(blk)
            tag = slots[p % bs] if slots is not None else None
            tag = g.tag if tag is None else tag
            if o.get(p, g.tag) != tag:
                g.invalidate(ev.worker, p // bs)
            if tag == g.tag:
                o.pop(p, None)
            else:
                o[p] = tag

    def _revive(self, w: _Worker, b: int) -> None:
        """A free-but-cached block shared again: unless something modified it
        since its last owner freed it, it holds the KV it held then."""
        entry = w.stash.pop(b, None)
        if entry is None or b >= w.nblocks:
            return
        stamp, rows, scales, origin = entry
        if self._version(w, b) != stamp:
            return
        self._main_touch(w.name)
        for i, r in enumerate(rows):
            _bytes(w.pools[i])[b].copy_(_bytes(r))
        for i, s in enumerate(scales):
            w.scales[i][b].copy_(s)
        if origin is not None:
            w.origin[b] = list(origin)
        self._touch(w, [b], self.line)

    def _on_transfer_start(self, ev: TransferStart, line: int) -> None:
        old = self._xfers.get(ev.transfer)
        if old is not None:  # id reuse: the old one is over
            self._unregister_lazy(old)
            self._drop_writer(old)
            self._release(old)
        t = _Xfer(ev, line)
        self._xfers[ev.transfer] = t
        self._gen(t.key).transfers.append(ev.transfer)
        self._worker(ev.src, "prefill", ev.src_blocks)
        self._worker(ev.dst, "decode", ev.dst_blocks)
        for b in set(ev.dst_blocks):
            self._writers.setdefault((ev.dst, b), set()).add(ev.transfer)
        if self.timing == "eager":  # posted now, done before the next event
            self._read(t, line)
            self._write(t, line)

    def _on_transfer_read_done(self, ev: TransferReadDone, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed or t.read:
            return
        if t.wrote:
            if t.lost:
                return  # the source memory is gone: no read can land any more
            self._late_read(t, line)
        else:
            self._read(t, line)

    def _on_transfer_write_done(self, ev: TransferWriteDone, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed or t.wrote:
            return
        # nothing is written that was not read: without a read_done yet, the
        # source is read now (and again at a later read_done if it changed)
        self._write(t, line)

    def _on_transfer_failed(self, ev: TransferFailed, line: int) -> None:
        t = self._xfers.get(ev.transfer)
        if t is None or t.failed:
            return
        t.failed = True
        if not t.wrote and not isinstance(self.transport, CopyTransport):
            self._fail_through_transport(t)
        self._unregister_lazy(t)
        self._release(t)
        if not t.wrote:
            w = self._workers.get(t.dst)
            if w is not None:
                self._worker(t.dst, need=t.dst_blocks)
                if not t.moves:
                    self._plan(t)
                if t.tokens is None:
                    self._poison(w, t.dst_blocks, line)  # a partial write: garbage
                else:
                    for _i, _sb, db, _p0, s0, s1 in t.moves:
                        self._poison(w, [db], line, s0, s1)
        self._drop_writer(t)

    def _fail_through_transport(self, t: _Xfer) -> None:
        """The transport's library reports ``t`` as failed (its first block),
        into a scratch block of the target worker: bytes a library moves all
        the same never reach the target's pool."""
        src = self._worker(t.src, "prefill", t.src_blocks)
        dst = self._worker(t.dst, "decode", t.dst_blocks)
        if src is None or dst is None or not t.src_blocks or not t.dst_blocks:
            return
        pairs = [
            (self._fail_target(t.dst, dst.pools[i][0]), src.pools[i][t.src_blocks[0]])
            for i in range(min(len(dst.pools), len(src.pools)))
            if dst.pools[i][0].shape == src.pools[i][0].shape
        ]
        if pairs:
            self.transport.fail(Transfer(t.tid, t.src, t.dst, self._pull, pairs=pairs))

    def _fail_target(self, worker: str, like: torch.Tensor) -> torch.Tensor:
        """A block of ``worker``'s, outside its pool, shaped as ``like`` (made once)."""
        key = (worker, tuple(like.shape), like.dtype)
        out = self._fail_targets.get(key)
        if out is None:
            out = self._fail_targets[key] = torch.zeros_like(like)
        return out

    def _on_transfer_abort(self, ev: TransferAbort, line: int) -> None:
        # an abort is a request, not a fence: the writes may still land (the
        # transport releases the transfer's handle while active when they do)
        t = self._xfers.get(ev.transfer)
        if t is not None and not t.wrote and not t.failed:
            t.aborted = True

    def _landed_for(self, g: _Gen, ticket: str, worker: str) -> list[_Xfer]:
        """The transfers of ``ticket`` into ``worker`` whose writes landed."""
        out = []
        for tid in g.transfers:
            t = self._xfers[tid]
            if t.ticket == ticket and t.dst == worker and t.wrote and not t.failed and not t.cancelled:
                out.append(t)
        return out

    def _commit_table(self, g: _Gen, ev: Commit) -> tuple[list[int] | None, int | None]:
        """The block table a commit makes readable: the generation's shared
        blocks on the worker, then the blocks the ticket reserved there; without
        a reservation, the blocks the ticket's landed transfers wrote, by the
        table index of the positions they moved."""
        bs = self.layout.block_size
        tline = None
        by_index: dict[int, int] = {}
        for tid in g.transfers:
            t = self._xfers[tid]
            if t.ticket == ev.ticket and t.dst == ev.worker and t.wrote and not t.failed and not t.cancelled:
                tline = t.line
                if not t.moves:
                    self._plan(t)
                for _i, _sb, db, p0, _s0, _s1 in t.moves:
                    by_index[p0 // bs] = db
        info = self._tickets.get(ev.ticket)
        if info is not None and info[1] == ev.worker and info[0] == g.key:
            return self._table(g, ev.worker, info[2]), tline
        if not by_index:
            return None, tline
        table = self._table(g, ev.worker, ())
        shared = len(table)
        for j in range(shared, max(by_index) + 1):
            if j not in by_index:
                break
            table.append(by_index[j])
        return table, tline

    def _on_commit(self, ev: Commit, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        table, tline = self._commit_table(g, ev)
        if table is None:
            return  # nothing to read: the monitor reports the commit itself
        table = tuple(table)
        g.committed = (ev.worker, table, line)
        if g.prefill_line is None:
            return
        what = "commit (KV made readable for decode)"
        witness = [tline, g.prefill_line]
        landed = self._landed_for(g, ev.ticket, ev.worker)
        if not landed or any(t.tokens is None and t.layers is None for t in landed):
            # nothing landed, or a transfer of every layer and position: the whole prompt
            self._verify(g, ev.worker, table, self._prompt(g), line, what, witness, ticket=ev.ticket)
            return
        # ranged transfers: exactly what landed, and the shared prefix
        prompt = self._prompt(g)
        bs = self.layout.block_size
        shared = g.shared.get(ev.worker)
        if shared and not self._verify(
            g, ev.worker, table, min(shared[1], prompt), line, what, witness, ticket=ev.ticket
        ):
            return
        for t in landed:
            if not t.moves:
                self._plan(t)
            items: list[tuple[int, int, int, int]] = []  # (block, first position, slots, first slot)
            for _i, _sb, _db, p0, s0, s1 in t.moves:
                s1 = min(s1, prompt - p0)
                if s0 >= s1:
                    continue
                if p0 // bs >= len(table):
                    if self._verify_items(
                        g, ev.worker, items, t.layers, line, what, witness + [t.line], t.tid, ev.ticket
                    ):
                        self._report_missing(
                            g, ev.worker, table, len(table) * bs, what, line, witness, t.tid, ev.ticket
                        )
                    return
                items.append((table[p0 // bs], p0 + s0, s1 - s0, s0))
            if not self._verify_items(
                g, ev.worker, items, t.layers, line, what, witness + [t.line], t.tid, ev.ticket
            ):
                return

    def _on_decode(self, ev: Decode, line: int) -> None:
        key = (ev.request, ev.gen)
        g = self._gen(key)
        same = False
        if g.last_decode is not None:
            # superseded by this step's check
            worker, table, _pos, _l = g.last_decode
            same = worker == ev.worker and table == ev.blocks
            if not same:
                for b in table:
                    if self._final.get((worker, b)) == key:
                        del self._final[(worker, b)]
            g.last_decode = None
        self._verify(
            g,
            ev.worker,
            ev.blocks,
            ev.position,
            line,
            f"decode at position {ev.position}",
            [g.committed[2] if g.committed else None, g.prefill_line],
        )
        w = self._worker(ev.worker, "decode", ev.blocks)
        if w is None:
            return
        bs = self.layout.block_size
        if ev.position // bs >= len(ev.blocks):
            self._report_missing(
                g,
                ev.worker,
                ev.blocks,
                len(ev.blocks) * bs,
                f"decode at position {ev.position} (its own KV)",
                line,
                [],
                None,
                None,
            )
        else:
            # a decode writes its input's KV at its position; under recompute the
            # first decode recomputes the last prompt token's, which is prompt KV
            recomputed = self._recompute and ev.position == self._prompt(g) - 1
            code = _PROMPT if recomputed else (ev.input_token + 1) & _M32
            self._write_positions(w, ev.blocks, [g.tag], ev.position, [code], line)
            o = g.orig.get(ev.worker)
            if o and o.pop(ev.position, None) is not None:
                g.invalidate(ev.worker, ev.position // bs)
        if ev.position + 1 >= self._prompt(g):
            self._expect_token(g, ev.position + 1, ev.output_token)
        g.last_decode = (ev.worker, ev.blocks, ev.position, line)
        if not same or any(self._final.get((ev.worker, b)) != key for b in ev.blocks[-1:]):
            for b in ev.blocks:
                self._final[(ev.worker, b)] = key

    def _on_end(self, ev: Finish | Cancel | Fail, line: int) -> None:
        g = self._gen((ev.request, ev.gen))
        self._final_check(g, line)
        g.terminal = True
        g.checked.clear()
        g.fast.clear()

    def _on_free(self, ev: Free, line: int) -> None:
        w = self._workers.get(ev.worker)
        if w is None:
            return
        keys = {self._final[(ev.worker, b)] for b in ev.blocks if (ev.worker, b) in self._final}
        for key in sorted(keys):
            self._final_check(self._gens[key], line)
        who = (ev.request, ev.gen) if ev.request is not None and ev.gen is not None else None
        gone = []
        for b in ev.blocks:
            owners = self._owner.get((ev.worker, b))
            if owners and who in owners and len(owners) > 1:
                owners.remove(who)  # a shared block: another reference keeps it
                continue
            self._owner.pop((ev.worker, b), None)
            for tid in self._writers.get((ev.worker, b), ()):
                self._xfers[tid].early_freed.add(b)
            gone.append(b)
        if who is not None:
            alloc = self._alloc.get(who, {}).get(ev.worker)
            if alloc:
                drop = set(ev.blocks)
                alloc[:] = [b for b in alloc if b not in drop]
        kept = self._stash(w, gone) if self._shares else {}
        self._poison(w, gone, line)
        for b, entry in kept.items():
            w.stash[b] = (self._version(w, b),) + entry[1:]

    def _stash(self, w: _Worker, blocks: Sequence[int]) -> dict[int, tuple]:
        """Before freed blocks are poisoned: what they hold, for a share that
        revives one while nothing else modified it (a prefix cache)."""
        out: dict[int, tuple] = {}
        keep = []
        for b in blocks:
            if b >= w.nblocks:
                continue
            old = w.stash.get(b)
            if old is not None and old[0] == self._version(w, b):
                out[b] = old  # freed again without a write: the cached KV is still the stashed one
                continue
            origin = w.origin.get(b)
            if origin is None or all(o is None for o in origin):
                continue
            keep.append(b)
        if not keep:
            return out
        self._main_touch(w.name)
        per_block = self.layout.fp8 and self.layout.scale == "per-block"
        if len(keep) > 1 and len(keep) * w.pos_bytes * self.layout.block_size <= _STASH_BATCH:
            # small blocks: one gather per part; each entry holds views of it
            idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
            rows = [_bytes(p).index_select(0, idx) for p in w.pools]
            scales = [s.index_select(0, idx) for s in w.scales] if per_block else []
            for j, b in enumerate(keep):
                out[b] = (0, [r[j] for r in rows], [s[j] for s in scales], list(w.origin[b]))
            return out
        for b in keep:
            out[b] = (
                0,
                [_bytes(p[b]).clone() for p in w.pools],
                [s[b].clone() for s in w.scales] if per_block else [],
                list(w.origin[b]),
            )
        return out

    def _on_restart(self, ev: Restart, line: int) -> None:
        self.transport.restart(ev.worker)
        w = self._workers.get(ev.worker)
        for wb in [wb for wb in self._owner if wb[0] == ev.worker]:
            del self._owner[wb]
        for wb in [wb for wb in self._final if wb[0] == ev.worker]:
            key = self._final.pop(wb)
            g = self._gens[key]
            if g.last_decode is not None and g.last_decode[0] == ev.worker:
                g.last_decode = None  # the memory is gone; nothing more to read
        for t in self._xfers.values():
            # a read still to come reads poison; writes still to come land
            # (the monitor quarantines their blocks); either way the data is lost
            if not t.failed and ((t.src == ev.worker and not t.read) or (t.dst == ev.worker and not t.wrote)):
                t.lost = True
        if w is None:
            return
        self._before_modify(w, range(w.nblocks), line)
        for pool in w.pools:
            _bytes(pool).fill_(self._nan)
        if self.layout.fp8 and self.layout.scale == "per-block":
            for s in w.scales:
                s.fill_(float("nan"))
        self._clock += 1
        w.restart_stamp = self._clock
        w.restart_line = line
        w.stamp.clear()
        w.mod.clear()
        self._restart_log(w)
        w.last_write.clear()
        w.origin.clear()
        w.stash.clear()
