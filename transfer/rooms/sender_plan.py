"""The prefill room's chunk planning (direct descriptors or staged parts per
decode rank) and its write-through to the storage tier. A base class of
:class:`transfer.sender.KVSender` (the same object's state)."""

from __future__ import annotations

import logging

import numpy as np

from bootstrap.messages import AttentionKind
from transfer.errors import RequestError
from transfer.plan import TransferPlan, check_transfer, page_runs, page_slice, plan_aux_regions, plan_pool
from transfer.staging.prefill_flow import mark_direct, part_bytes_for, plan_parts
from transfer.state import KVPoll

log = logging.getLogger("kvferry.sender")


class SenderPlan:
    """Chunk planning and write-through of a :class:`KVSender`."""

    def _write_through(self, pages: np.ndarray, first: int, last: bool, gate=None) -> None:
        """Queue the chunk's full pages (and, with the last chunk, the aux
        row) for the storage tier. MLA pools are the same on every TP rank,
        so only rank 0 writes them."""
        tier, rank = self._ctx.storage, self._ctx.rank
        end = min(first + pages.size, len(self._chains))
        items = {}
        if end > first:
            chains = self._chains[first:end]
            for role in tier.pools:
                if rank.pool(role).attention is AttentionKind.MLA and rank.tp_rank != 0:
                    continue
                items[role] = (tier.keys(role, chains), pages[:end - first].tolist())
        aux = (self._aux_key, self._aux_index) if last and self._aux_index is not None and rank.tp_rank == 0 \
            and tier.has_aux else None
        if not items and aux is None:
            return
        self._storage_pending += 1
        tier.write(items, aux, self._on_storage_done, ready=gate)

    def _on_storage_done(self, job) -> None:
        with self._ctx.lock:
            self._storage_pending -= 1
            if job.error is not None:
                log.warning("%s: write-through failed (the transfer is not affected): %s", self._state.where,
                            job.error)
            if self._state.state is KVPoll.Transferring and self._decode_told and not self._storage_pending:
                self._succeed()
            elif self._state.terminal:
                self._ctx.changed(self, self._state.state)  # poll() may now report it

    def _plan_chunk(self, pages: np.ndarray, last: bool) -> tuple[list[tuple[str, TransferPlan, list]], list]:
        """Direct descriptor plans per decode rank (with what each moves per
        pool, for the room's stats), and staged parts where direct
        descriptors would be small (scattered pages, head slices)."""
        end = self._offset + pages.size
        if end > self._num_pages:
            raise RequestError(f"{self._state.where}: {end} pages sent, more than the {self._num_pages} of init()")
        if last and end != self._num_pages:
            raise RequestError(f"{self._state.where}: last chunk ends at page {end} of {self._num_pages}")
        local = self._ctx.rank
        jobs, staged = [], []
        for req in self._requests:
            peer = self._table.peers[req.decode_session]
            skip = min(pages.size, max(0, req.skip_pages - self._offset))  # decode has these from storage
            src = pages[skip:]
            dst = np.frombuffer(req.dst_pages, dtype="<i4")[self._offset + skip:end]
            sent = [a for a in req.assignments if a.send] if src.size else []
            plans, roles = [], []
            if sent and self._stage(src, dst, sent, local, peer):
                for a in sent:  # the same checks as the direct path, before any byte moves
                    check_transfer(local.pool(a.role), peer.pool(a.role), src, dst.astype(np.int64),
                                   src_head_offset=a.src_head_offset, dst_head_offset=a.dst_head_offset,
                                   num_heads=a.num_heads)
                new = plan_parts(self, req, src, self._offset + skip, local, peer, part_bytes_for(self._ctx, peer),
                                 self._next_part)
                mark_direct(new, self._ctx)
                self._next_part += len(new)
                staged.extend(new)
            else:
                plans = [plan_pool(local.pool(a.role), peer.pool(a.role), src, dst,
                                   src_head_offset=a.src_head_offset, dst_head_offset=a.dst_head_offset,
                                   num_heads=a.num_heads) for a in sent]
                roles = [a.role.value for a in sent]
            if last and local.aux and self._aux_index is not None and req.dst_aux_index >= 0:
                aux = plan_aux_regions(local.aux, peer.aux, self._aux_index, req.dst_aux_index)  # checks slots
                if not peer.fenced:  # a fenced rank gets the row in RoomStatus
                    plans.append(aux)
                    roles.append("aux")
            moved = [(role, "direct", p.total_bytes, p.num_descriptors) for role, p in zip(roles, plans)
                     if p.num_descriptors]
            # Always a job, empty or not: its completion is what ends a room
            # for ranks that send nothing.
            jobs.append((req.decode_session, TransferPlan.concat(plans), moved))
        return jobs, staged

    def _stage(self, pages, dst, sent, local, peer) -> bool:
        """Whether this chunk goes through staging: always for a fenced peer,
        else when both sides have it and the direct descriptors would
        average less than ``stage_below_bytes``."""
        if peer.fenced and pages.size:
            return True
        if self._ctx.staging is None or peer.staging is None or not pages.size:
            return False
        runs = page_runs(pages, dst).lengths.size
        total = count = 0
        for a in sent:
            pool = local.pool(a.role)
            sl, dl = page_slice(pool, a.src_head_offset, a.num_heads), \
                page_slice(peer.pool(a.role), a.dst_head_offset, a.num_heads)
            buffers = len(pool.buffers)
            whole = sl.rows == dl.rows == 1 and sl.nbytes == sl.row_bytes and dl.nbytes == dl.row_bytes
            total += pages.size * sl.packed_bytes * buffers
            count += runs * buffers if whole else pages.size * sl.rows * buffers
        return total / count < self._ctx.config.stage_below_bytes
