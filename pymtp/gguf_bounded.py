"""gguf-py's GGUFReader, refusing to read past the end of the file.

On its own it reads past the end as empty arrays: with an array length corrupted to
~2**63 (one flipped header byte, found by tests/test_fuzz_gguf.py) it loops, appending
empty arrays, until memory runs out (19 GB in minutes). Lengths the file cannot hold
are refused at once, and so are longer arrays than any model's metadata has.

Used by gguf_graft, which reads whole files to write another. The runtime reads only
headers, with gguf_header: this reader takes seconds on a 248k vocabulary.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType

MAX_ARRAY = 1 << 24  # metadata array elements; vocabularies hold a few hundred thousand


class BoundedReader(GGUFReader):
    """A GGUFReader whose reads past the end raise ValueError instead of coming back short."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"it ends at byte {len(self.data)} but needs bytes up to {end}")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        # refuse a length the rest of the file cannot hold; int(): numpy's own comparison with
        # an Enum swallows a KeyboardInterrupt raised inside it (a Ctrl-C lost)
        if int(raw_type) == GGUFValueType.ARRAY:
            item = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            n = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item)
            least = np.dtype(scalar).itemsize if scalar is not None else 8   # a string: its length
            if n > MAX_ARRAY or n * least > len(self.data) - orig_offs - 12:
                raise ValueError(f"the array at byte {orig_offs} claims {n} elements, more than "
                                 f"the file can hold")
        return super()._get_field_parts(orig_offs, raw_type)
