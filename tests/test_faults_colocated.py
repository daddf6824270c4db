"""Faults at every phase on the colocated backend (shared memory and CUDA IPC on one
host), across real processes: the trainer or a rollout SIGKILLed or SIGSTOPped at each
phase; every survivor raises within its deadline naming the phase, nothing is left in
/dev/shm. (Its own module: the suite's workers run it beside tests/test_faults.py.)"""

import pytest
from faults_common import LOST, PHASES, check_peer_lost

COLOCATED = [x for x in LOST if x[0] == "colocated"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("backend,who,how", COLOCATED, ids=["-".join(x) for x in COLOCATED])
def test_peer_lost_at_every_phase(port, backend, phase, who, how):
    """1 trainer, 2 rollouts. After one good update the trainer or rollout 2 is SIGKILLed
    or SIGSTOPped at ``phase`` of the next; every survivor raises within the deadline
    naming the phase, claims no version it does not hold, and the trainer's shared memory
    is gone from /dev/shm."""
    check_peer_lost(port, backend, phase, who, how)
