"""Delta updates for the bucket engines (``delta=True``; all but ``colocated``, whose
floor is a copy on the same device): every trainer rank sends what
changed in its *own* piece of every tensor since the version the receivers hold, so no
rank gathers unchanged bytes and no rank funnels the others' changes.

At RL learning rates most bf16 weights do not change between steps (an fp32 master moves
far less than a bf16 rounding step): 1-15 % of elements change per step, often ~1 %.

Per update, after the core's header:

1. **Agree.** Every rank says which version it holds (trainer ranks: the version of their
   snapshot; receivers: the version they hold whole, and a chain digest of every patch they
   applied since their last full update). One small all-reduction: a delta goes only if
   every rank holds the same version and every receiver the same chain; otherwise the
   update is *full* (a late joiner, a receiver that missed or failed an update).
2. **Diff where the bytes are.** Trainer rank r takes its piece of every tensor: its own
   dim-0 shard of an FSDP2/DTensor parameter (no communication), or its 1/T of a tensor
   every rank holds whole. Cast to the wire dtype, it is compared bit for bit with the
   snapshot of what that rank sent last (kept on the tensor's device: the rank's share of
   one wire-dtype copy). Each piece becomes records of at most a bucket each, encoded as
   positions + values, bitmap + values, or dense values, whichever is smallest; a full
   update sends dense records.
3. **Move.** Records are packed whole into buckets; the ranks agree on every bucket's size
   (one more small max-reduction per round: the counts, the flags and the first sizes)
   and the engine's own transport moves them (bucket b from trainer b mod T, as every
   update), trailers checked on every receiver. An update goes in rounds
   (:func:`.sender._budget`, the last one small: it is the update's tail): each round's
   records are made, agreed on and sent, and the next round is diffed while they move and
   are applied; on a GPU its first diff is launched before the last round is agreed on,
   so the device works through the agreement. The device's records' arena holds one
   round. A GPU receiver reads a round's checks back once it has joined the next round's
   agreement (and before a slot takes another bucket): its writes run meanwhile.
4. **Apply, verify.** A receiver writes every record into its destination tensors in place
   (``set_destinations``; the manager's workers set them from their sink). Each delta
   record carries ``sum(w(pos) * (new - old))`` over its positions, ``old`` being the
   trainer's snapshot; the receiver computes the same with *its* old values before writing,
   so a corrupt patch, a misplaced one or a receiver whose copy drifted is an error naming
   the tensor and the range, never silent.
5. **Verify the whole destination.** A patch's digest covers only what it touched: a copy
   that changed elsewhere (a bit flip, an engine or a user writing a weight) would apply
   every patch cleanly. Each receiver therefore keeps a running digest of every destination
   tensor, ``sum(w(i) * x[i])`` over all its elements: computed from the tensor after a
   full update, moved by every applied record's digest (the digest is linear, so the
   patches' digests are exactly how far it moves), and checked against a fresh pass over
   the tensors every ``verify_every`` delta updates (one read of the destinations, by the
   same kernels). The pass reads the tensors before the update writes, against the sums
   the last update left, while the trainers diff (:class:`.receiver.WholeCheck`): a read
   after the last write was the update's last step. It covers every change since the
   last check: a copy that drifted between updates fails the next delta update, as it
   would have with a read at the end; one that drifted during an update, the one after.
   A mismatch names the tensors that drifted and fails the update, after which the
   receiver holds no version and the next update is sent whole: the resync.

The package by role: :mod:`.encoding` (the record format both sides read), :mod:`.sender`
(steps 2-3 on a trainer rank), :mod:`.receiver` (steps 4-5), :mod:`.protocol` (what delta
mode needs of its engine, and the agreement and plan both sides compute together).

On a host, step 2 and step 4 run as C kernels (:mod:`.cpu`: one pass over memory
each, on a few threads); on a GPU as Triton kernels (:mod:`.gpu`: many pieces per
launch); without a C compiler or Triton, as torch ops (the same records, bit for bit).

Why hand-written: no library of the field diffs sharded tensors and applies the patches
into an inference engine's own tensors (verl's ``delta_sharded`` gathers the changes to
trainer rank 0; vLLM's sparse path takes user-made patches one tensor at a time).
"""

from weightbus.engines.delta.encoding import BITMAP, DENSE, DIGEST, FULL, SPARSE, body_sizes, record_bytes
from weightbus.engines.delta.protocol import Engine, settle
from weightbus.engines.delta.receiver import Chain, digests, receive
from weightbus.engines.delta.sender import Snapshots, pieces_of, records, send

__all__ = ["BITMAP", "DENSE", "DIGEST", "FULL", "SPARSE", "Chain", "Engine", "Snapshots", "body_sizes",
           "digests", "pieces_of", "receive", "record_bytes", "records", "send", "settle"]
