"""The batch's KV memory: one preallocated store per layer, a slot per row.

Each layer keeps keys and values of shape (slots, kv_heads, columns, head_dim), its own
head shape where its ``LayerKind`` says so (a layer that reads another layer's keys and
values, as Gemma 4's KV-shared layers, is not in the store). A row's token at position
p sits in column p of its slot (a sliding-window layer keeps a ring of ``window``
columns: column (p - r) % window, with the rotation r the row's own rotating cache has,
so attention sums its keys in the order it would alone; on the CPU a row batched then
gives that row's logits alone to the bit). Rows never share columns and are never
padded against each other, so:

- rows join by copying their prefill caches into free slots, one update per layer
  for each run of neighbouring free slots;
- a row that leaves frees its slot and nothing moves: moving live rows into the freed
  slots copied every layer whole (a gather; MLX cannot update a layer in place from
  its own rows), tens of ms on a GPU at 128 rows for each row that left. The live
  rows are compacted only where the store shrinks (``_fit``), which reallocates anyway;
- a decode step writes every row's new key with one scatter per layer (``step.py``),
  and every layer of a kind shares one mask and one index array, built once per step
  from positions the host already knows (nothing is read back).

The number of slots follows the number of rows in coarse buckets, so steps keep the
same shapes while rows come and go; the free slots compute on garbage that nothing
reads. Row i of the batch is in slot ``slot_of[i]``; a step's tokens and logits are
in slot order (``slot_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

COLUMN_STEP = 256  # columns are added in steps of this many (as mlx-lm's caches do)
# Steps attend to a prefix of the columns, rounded up to at least this many.
SPAN_STEP = 32


def round_up_coarsely(n: int, min_step: int) -> int:
    """``n`` rounded up to an eighth of its power of two (in steps of at least
    ``min_step``): at most ~1/8 more, and about 8 distinct values per doubling, so
    shapes sized by it repeat (compiled traces, kernels, the backend's per-shape setup)."""
    step = max(min_step, (1 << (max(n - 1, 1).bit_length() - 1)) // 8)
    return -(-n // step) * step


def attention_span(longest: int) -> int:
    """Columns a step attends to for rows up to ``longest`` positions (see
    ``round_up_coarsely``)."""
    return round_up_coarsely(longest, SPAN_STEP)


_SLOT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def slot_bucket(rows: int) -> int:
    for size in _SLOT_BUCKETS:
        if rows <= size:
            return size
    return -(-rows // 128) * 128


def slot_buckets(rows: int) -> list[int]:
    """Every number of slots a batch of up to ``rows`` rows can have."""
    sizes = [slot_bucket(1)]
    while sizes[-1] < rows:
        sizes.append(slot_bucket(sizes[-1] + 1))
    return sizes


@dataclass
class LayerKind:
    """Layers that share a mask: full attention (window None) or one sliding window.
    ``kv_heads``/``head_dim``: this layer's, where they differ from the store's (Gemma 4's
    full-attention layers have wider heads); every layer of one kind has the same."""

    window: int | None
    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass
class StepLayout:
    """What every layer of one kind needs for one decode step."""

    write_index: mx.array  # (slots, kv_heads, 1, head_dim): column each row writes
    # The keys each row may attend to (a prefix of the columns), as attention takes them:
    # (slots, 1, 1, span) bool, or with counts, (slots,) int32: how many.
    visible: mx.array


class SlotStore:
    def __init__(self, layer_kinds: list[LayerKind], kv_heads: int, head_dim: int):
        self.layer_kinds = layer_kinds
        self.kinds = sorted({k.window or 0 for k in layer_kinds})
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        # Per kind (window or 0): the (kv_heads, head_dim) of its layers.
        self.kind_dims: dict[int, tuple[int, int]] = {}
        for kind in layer_kinds:
            dims = self._dims(kind)
            if self.kind_dims.setdefault(kind.window or 0, dims) != dims:
                raise ValueError(f"layers of window {kind.window} differ in head shape")
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None
        self.lengths: list[int] = []  # tokens each live row holds (its next position)
        self.slot_of: list[int] = []  # the slot of each live row
        # Per row, how far its rotary position runs from its length (Qwen-VL's mRoPE
        # delta after an image); all zero for most families.
        self.shifts: list[int] = []
        # Per row, per window: the ring's rotation r (position p at column (p - r) %
        # window), the one the row's own rotating cache goes on with. Before the ring
        # is full, r is 0 (the cache then holds position p at index p).
        self.rotations: list[dict[int, int]] = []
        self.reallocations = 0  # times the store took new arrays (a slow turn's log counts them)

    # -- shape -------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def nbytes(self) -> int:
        if not self.keys:
            return 0
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def _dims(self, kind: LayerKind) -> tuple[int, int]:
        return kind.kv_heads or self.kv_heads, kind.head_dim or self.head_dim

    def _columns(self, kind: LayerKind, needed: int) -> int:
        columns = -(-needed // COLUMN_STEP) * COLUMN_STEP
        return min(columns, kind.window) if kind.window else columns

    def _resize(self, slots: int, needed_columns: int, dtype, shrink: bool = False) -> None:
        """Reallocate to ``slots`` slots holding at least ``needed_columns`` positions,
        keeping the live rows (layers already that size are left alone). Columns only
        grow unless ``shrink``; with ``shrink`` the live rows are compacted into slots
        [0, rows)."""
        where = self.slot_order() if shrink else None  # None: rows already in [0, rows)
        compact = where is not None
        keys, values = [], []
        fresh = False  # whether any layer took new arrays
        for i, kind in enumerate(self.layer_kinds):
            columns = self._columns(kind, needed_columns)
            old = self.keys[i] if self.keys is not None else None
            if old is not None:
                columns = columns if shrink else max(columns, old.shape[2])
                if old.shape[0] == slots and old.shape[2] == columns and not compact:
                    keys.append(old)
                    values.append(self.values[i])
                    continue
            kv_heads, head_dim = self._dims(kind)
            shape = (slots, kv_heads, columns, head_dim)
            k, v = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
            fresh = True
            if old is not None and self.rows:
                c = min(columns, old.shape[2])
                if compact:
                    n = self.rows
                    k[:n, :, :c] = mx.take(old[:, :, :c], where, axis=0)
                    v[:n, :, :c] = mx.take(self.values[i][:, :, :c], where, axis=0)
                else:  # every slot keeps its place (the free ones hold garbage anyway)
                    n = min(slots, old.shape[0], max(self.slot_of) + 1)
                    k[:n, :, :c] = old[:n, :, :c]
                    v[:n, :, :c] = self.values[i][:n, :, :c]
            keys.append(k)
            values.append(v)
        self.reallocations += fresh
        self.keys, self.values = keys, values
        if compact:
            self.slot_of = list(range(self.rows))

    # -- rows joining and leaving ------------------------------------------------------

    def join(self, row_caches: list[list], shifts: list[int] | None = None) -> None:
        """Copy prefilled rows in: each is one row's per-layer mlx-lm caches
        (``KVCache`` for full attention, ``RotatingKVCache`` for a window), with its
        rotary position shift."""
        lengths = [caches[0].offset for caches in row_caches]
        rows = self.rows + len(row_caches)
        needed = max([*self.lengths, *lengths]) + 1
        dtype = row_caches[0][0].keys.dtype
        if self.keys is None or rows > self.slots or needed > self._capacity():
            self._resize(max(slot_bucket(rows), self.slots), needed, dtype)
        rotations = [
            {kind.window: _rotation(cache, kind.window)
             for kind, cache in zip(self.layer_kinds, caches) if kind.window}
            for caches in row_caches
        ]
        free = self._free_slots()[:len(row_caches)]
        runs = _runs(free)
        for i, kind in enumerate(self.layer_kinds):
            joining = [_in_store_order(caches[i], kind.window, turn.get(kind.window, 0))
                       for caches, turn in zip(row_caches, rotations)]
            # One update per layer for each run of neighbouring free slots (one per row
            # copied the layer whole for each); shorter rows are padded with zeros
            # their counts never reach.
            width = max(k.shape[2] for k, _ in joining)
            for store, part in ((self.keys, 0), (self.values, 1)):
                block = mx.concatenate([_pad_columns(row[part], width) for row in joining], axis=0)
                for first, count, at in runs:
                    store[i][first:first + count, :, :width] = block[at:at + count]
        self.slot_of += free
        self.lengths += lengths
        self.rotations += rotations
        self.shifts += shifts or [0] * len(row_caches)

    def fill_row_cache(self, row: int, caches: list) -> None:
        """Fill fresh single-request caches (one per layer, as ``join`` takes them) with
        what live row ``row`` holds now: the inverse of ``join``, as copies, so the row
        can go on being prefilled later (a chat's next turn) while its slot moves on."""
        length, slot = self.lengths[row], self.slot_of[row]
        for i, (kind, cache) in enumerate(zip(self.layer_kinds, caches)):
            keys, values = self.keys[i][slot:slot + 1], self.values[i][slot:slot + 1]
            if kind.window is None:
                keys, values = keys[:, :, :length], values[:, :, :length]
            else:
                keys, values = _in_temporal_order(keys, values, length, kind.window,
                                                  self.rotations[row][kind.window])
            cache.keys, cache.values = mx.contiguous(keys), mx.contiguous(values)
            cache.offset = length
            if kind.window is not None:
                cache._idx = cache.keys.shape[2]  # a ring in temporal order, as after a pass

    def _capacity(self) -> int:
        """Positions every layer can hold (a full window never runs out)."""
        capacity = 1 << 62
        for keys, kind in zip(self.keys, self.layer_kinds):
            if not (kind.window and keys.shape[2] >= kind.window):
                capacity = min(capacity, keys.shape[2])
        return capacity

    def keep(self, indices: list[int]) -> None:
        """Keep the live rows at ``indices`` (ascending), in their order and their
        slots; the others' slots are free."""
        if not indices:
            self.reset()
            return
        for name in ("lengths", "shifts", "rotations", "slot_of"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in indices])
        self._fit(len(indices))

    def _free_slots(self) -> list[int]:
        taken = set(self.slot_of)
        return [slot for slot in range(self.slots) if slot not in taken]

    def slot_order(self) -> mx.array | None:
        """The slot of each row as an index array, or None where row i is in slot i
        (then a step's first ``rows`` slots are the rows, in order)."""
        if self.slot_of == list(range(self.rows)):
            return None
        return mx.array(self.slot_of, mx.int32)

    def per_slot(self, row_values: list, fill) -> list:
        """``row_values`` (one per row) placed at their rows' slots, ``fill`` at free ones."""
        out = [fill] * self.slots
        for slot, value in zip(self.slot_of, row_values):
            out[slot] = value
        return out

    def _fit(self, rows: int) -> None:
        """Give memory back once the rows that needed it have left: half the slots or
        half the columns unused is reallocated at the size the live rows need."""
        slots = slot_bucket(rows)
        needed = max(self.lengths) + 1
        wide = any(
            keys.shape[2] > 2 * self._columns(kind, needed)
            for keys, kind in zip(self.keys, self.layer_kinds)
        )
        slots = slots if slots * 2 < self.slots else self.slots
        if wide or slots < self.slots:
            self._resize(slots, needed, self.keys[0].dtype, shrink=True)

    def reset(self) -> None:
        self.keys = self.values = None
        self.lengths = []
        self.slot_of = []
        self.shifts = []
        self.rotations = []

    # -- one decode step ---------------------------------------------------------------

    def layout(self, counts: bool = False) -> tuple[mx.array, dict[int, StepLayout]]:
        """Positions of this step's tokens (slots,) and, per kind, where they are
        written and what they attend to (a mask, or with ``counts`` how many leading
        columns). Grows the store first if a row needs it."""
        longest = max(self.lengths) + 1
        if longest > self._capacity():
            self._resize(self.slots, longest, self.keys[0].dtype)
        positions = mx.array(self.per_slot(self.lengths, 0), mx.int32)
        if counts:
            # Every kind's count is the row's own keys, its new one included: a window's
            # ring never holds more than the window, which is its layers' column count.
            visible = mx.array(self.per_slot([n + 1 for n in self.lengths], 1), mx.int32)
        layouts = {}
        for window in self.kinds:
            if window:
                column = mx.array(self.per_slot(
                    [(p - r[window]) % window for p, r in zip(self.lengths, self.rotations)], 0), mx.int32)
                span = min(window, attention_span(longest))
            else:  # a full-attention row writes at its position
                column = positions
                span = attention_span(longest)
            kv_heads, head_dim = self.kind_dims[window]
            write_index = mx.broadcast_to(
                column[:, None, None, None], (self.slots, kv_heads, 1, head_dim)
            )
            if not counts:
                # A ring column i holds a valid key once i <= position (it fills from 0
                # and then keeps the last `window` positions); a full-attention column
                # the same.
                visible = (mx.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
            layouts[window] = StepLayout(write_index, visible)
        return positions, layouts

    def rope_positions(self, positions: mx.array) -> mx.array:
        """This step's rotary positions: ``positions`` plus each row's shift."""
        if not any(self.shifts):
            return positions
        return mx.array(self.per_slot([n + s for n, s in zip(self.lengths, self.shifts)], 0), mx.int32)

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Ascending ``slots`` as runs of neighbours: (first slot, count, index in ``slots``)."""
    runs = []
    for at, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((slot, 1, at))
    return runs


def _pad_columns(x: mx.array, width: int) -> mx.array:
    """``x`` (1, heads, columns, dim) widened to ``width`` columns with zeros."""
    if x.shape[2] == width:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)])


def _rotation(cache, window: int) -> int:
    """The rotation of a row's ring: the column its rotating cache would write its next
    position to (mlx-vlm's ``RotatingKVCache._update_in_place``: a buffer longer than
    the window is trimmed and written from column 0, as is a full one; otherwise at its
    index) is that position's column."""
    buffered = cache.keys.shape[2] if cache.keys is not None else 0
    column = 0 if buffered > window or cache._idx >= window else cache._idx
    return (cache.offset - column) % window


def _in_store_order(cache, window: int | None, rotation: int = 0) -> tuple[mx.array, mx.array]:
    """One row's keys/values as the store keeps them: position p in column p, or in a
    window's ring, position p in column (p - rotation) % window."""
    length = cache.offset
    if window is None:
        return cache.keys[..., :length, :], cache.values[..., :length, :]
    keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    held = min(length, window)
    keys, values = keys[..., -held:, :], values[..., -held:, :]
    first = length - held  # position of the oldest key held
    shift = (first - rotation) % window
    if shift:  # ring order: position p at column (p - rotation) % window
        keys = mx.concatenate([keys[..., window - shift:, :], keys[..., : window - shift, :]], axis=2)
        values = mx.concatenate(
            [values[..., window - shift:, :], values[..., : window - shift, :]], axis=2
        )
    return keys, values


def _in_temporal_order(keys: mx.array, values: mx.array, length: int, window: int,
                       rotation: int) -> tuple[mx.array, mx.array]:
    """A window's ring of one row (position p in column (p - rotation) % window) as
    its last ``min(length, window)`` positions, oldest first."""
    held = min(length, window)
    start = (length - held - rotation) % window  # the column of the oldest position held
    if held < window or start == 0:  # a ring not yet full has rotation 0
        return keys[:, :, start:start + held], values[:, :, start:start + held]
    return (mx.concatenate([keys[:, :, start:window], keys[:, :, :start]], axis=2),
            mx.concatenate([values[:, :, start:window], values[:, :, :start]], axis=2))
