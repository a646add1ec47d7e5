"""Learning on the editing toy world (--model toy-edit: rundir.TOY_EDIT_WORLD, a FluxKontextPipeline trained on
toy/edit_world.py's edits, rewarded for carrying the instruction out and for keeping the rest of the source): every
algorithm file's TOY preset raises the held-out instruction reward (toy_edit) of ODE samples on fixed (instruction,
source, seed) triples beyond 2 paired standard errors against the base model in a short run. The runs use one
thread each, in two processes side by side; the base model is evaluated once."""
import pytest

from helpers import learning_gain, learning_runs

pytestmark = pytest.mark.slow

PAIRS = 64
# name: (script, iterations, flags on top of the preset, process). Each run is the shortest that clears 3 SE,
# measured here (toy_edit gain +- paired SE on the 64 triples, seed 0, one thread; docs/editing.md has the table)
CASES = {
    "flow_grpo": ("flow_grpo.py", 1, [], 0),
    "densegrpo": ("densegrpo.py", 1, ["--dense-ode-steps", "2"], 1),
    "diffusion_nft": ("diffusion_nft.py", 1, [], 0),
    "awm": ("awm.py", 1, [], 0),
    "dgpo": ("dgpo.py", 1, [], 1),
    "flow_dppo": ("flow_dppo.py", 1, [], 1),
    "dancegrpo": ("dancegrpo.py", 1, [], 0),
    "g2rpo": ("g2rpo.py", 1, ["--lambdas", "1"], 1),
    "mixgrpo": ("mixgrpo.py", 1, [], 1),
    "dpo": ("dpo.py", 1, [], 1),
    "crd": ("crd.py", 1, [], 0),
}
BASE = "flow_grpo"  # every preset samples the same evaluation triples: one base evaluation serves all


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return learning_runs(tmp_path_factory, CASES, model="toy-edit", base=BASE, pairs=PAIRS, timeout=3600)


@pytest.mark.parametrize("name", CASES)
def test_edit_reward_rises_on_the_editing_toy(runs, name):
    gain, se, _ = learning_gain(runs, name, cases=CASES, base=BASE, metric="toy_edit")
    assert gain > 2 * se, (gain, se)
