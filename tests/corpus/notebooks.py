# Notebooks: each pattern is a run of cells in a real Jupyter kernel (ipykernel, started with
# jupyter_client as a notebook server starts it), re-running and editing cells the way users do.
# The last cell of each pattern is a @pattern function that returns what the cells computed. This
# script drives the kernel: `python - EXECUTOR < notebooks.py`, in the folder that holds the user's
# modules (the kernel's working directory). The outcome lines are the kernel's printed output.
import os
import sys

from jupyter_client.manager import start_new_kernel

SETUP = [
    "import os, sys, importlib, multiprocessing, concurrent.futures\n"
    "import numpy as np\n"
    "import corpus\n"
    "from corpus import pattern, write\n"
    "from hardy import Pipeline, node\n"
    "engine = corpus.engine()\n"
    "XS = [1, 2, 3]\n"
    "def ys(nodes, xs=XS, output='y'):\n"
    "    return [o[output] for o in Pipeline(nodes=nodes, engine=engine).map(inputs={'x': xs}, map_over='x')]",
]

PATTERNS = [
    # a cell defining a helper and a global, edited and run again
    ["def helper(x):\n    return 100 * x + 1\nFACTOR = 2",
     "@node(output_name='y')\ndef scaled(x):\n    return helper(x) * FACTOR",
     "first = ys([scaled])",
     "def helper(x):\n    return 1000 * x + 1\nFACTOR = 3",
     "@pattern\ndef cell_redefining_a_helper_and_a_global():\n    return [first, ys([scaled])]"],
    # a cell changing a global dict in place (a config filled by a later cell)
    ["CONFIG = {'scale': 1}",
     "@node(output_name='y')\ndef configured(x):\n    return x * CONFIG['scale']",
     "first = ys([configured])",
     "CONFIG['scale'] = 40\nCONFIG['unused'] = list(range(3))",
     "@pattern\ndef cell_changing_a_global_dict_in_place():\n    return [first, ys([configured])]"],
    # %autoreload 2, the node's module edited on disk between two cells
    ["%load_ext autoreload\n%autoreload 2",
     "write('nb_steps.py', '''\nfrom hardy import node\n\n@node(output_name=\"y\")\ndef transform(x):\n"
     "    return x * 10\n''')\nimport nb_steps",
     "first = ys([nb_steps.transform])",
     "write('nb_steps.py', '''\nfrom hardy import node\n\n@node(output_name=\"y\")\ndef transform(x):\n"
     "    return x * 100 + 1\n''')",
     "@pattern\ndef autoreload_of_the_nodes_module():\n    return [first, ys([nb_steps.transform]), nb_steps.transform(1)]"],
    # %autoreload 2 on a helper module, the node defined in the notebook
    ["write('nb_helpers.py', 'LIMIT = 2\\ndef clip(x):\\n    return min(x, LIMIT)\\n')\nimport nb_helpers",
     "@node(output_name='y')\ndef clipped(x):\n    return nb_helpers.clip(x)",
     "first = ys([clipped])",
     "write('nb_helpers.py', 'LIMIT = 2\\ndef clip(x):\\n    return max(x, LIMIT) * 7\\n')",
     "@pattern\ndef autoreload_of_a_helper_module():\n    return [first, ys([clipped])]"],
    # a module edited with autoreload off: the kernel keeps the code it loaded
    ["%autoreload 0",
     "write('nb_frozen.py', 'def value(x):\\n    return x + 1\\n')\nimport nb_frozen",
     "@node(output_name='y')\ndef valued(x):\n    return nb_frozen.value(x)",
     "write('nb_frozen.py', 'def value(x):\\n    return x - 1\\n')",
     "@pattern\ndef module_edited_with_autoreload_off():\n    return [ys([valued]), nb_frozen.value(1)]"],
    # a node redefined in a cell, the pipeline rebuilt; and one built before, kept
    ["@node(output_name='y')\ndef stepped(x):\n    return x + 1",
     "kept = Pipeline(nodes=[stepped], engine=engine)\nfirst = ys([stepped])",
     "@node(output_name='y')\ndef stepped(x):\n    return x + 2",
     "@pattern\ndef cell_redefining_a_node():\n"
     "    return [first, ys([stepped]), [o['y'] for o in kept.map(inputs={'x': XS}, map_over='x')]]"],
    # a big global array rebound by a cell
    ["TABLE = np.zeros(10)",
     "@node(output_name='y')\ndef looked_up(x):\n    return [float(TABLE[x]), float(TABLE.sum())]",
     "first = ys([looked_up])",
     "TABLE = np.arange(100_000, dtype=np.float64)",
     "@pattern\ndef cell_rebinding_a_big_array():\n    return [first, ys([looked_up])]"],
    # a class redefined by a cell; an instance made before is given as input
    ["class Scaler:\n    def __init__(self, k):\n        self.k = k\n    def apply(self, x):\n        return x * self.k",
     "old = Scaler(3)",
     "class Scaler:\n    def __init__(self, k):\n        self.k = k\n    def apply(self, x):\n        return -x * self.k",
     "@node(output_name='y')\ndef applied(x, scaler):\n    return scaler.apply(x)",
     "@pattern\ndef cell_redefining_a_class_with_old_instances_as_inputs():\n"
     "    p = Pipeline(nodes=[applied], engine=engine)\n"
     "    return [[o['y'] for o in p.map(inputs={'x': XS, 'scaler': s}, map_over='x')] for s in (old, Scaler(3))]"],
    # %env and %cd magics between calls
    ["os.makedirs('nbdata', exist_ok=True)\nopen('nbdata/label.txt', 'w').write('from-nbdata')",
     "@node(output_name='y')\ndef env_and_file(x):\n    label = open('label.txt').read() if os.path.exists('label.txt') else '-'\n"
     "    return [os.environ.get('NB_MODE', 'unset'), label, x]",
     "first = ys([env_and_file], xs=[1])",
     "%env NB_MODE=magic",
     "%cd nbdata",
     "@pattern\ndef env_and_cd_magics_between_calls():\n    return [first, ys([env_and_file], xs=[1])]",
     "%cd ..\n%env NB_MODE=done"],
    # a node's own pools: fork over a notebook helper, spawn and forkserver over a module's
    ["def cube(v):\n    return v ** 3",
     "write('nb_pool_helpers.py', 'OFFSET = 0\\ndef shifted(v):\\n    return v + OFFSET\\n')\nimport nb_pool_helpers",
     "@node(output_name='y')\ndef pooled(x):\n"
     "    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
     "        forked = pool.map(cube, range(x + 1))\n"
     "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
     "        spawned = pool.map(nb_pool_helpers.shifted, range(x))\n"
     "    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('forkserver')) as pool:\n"
     "        served = list(pool.map(nb_pool_helpers.shifted, range(x)))\n"
     "    return [forked, spawned, served]",
     "nb_pool_helpers.OFFSET = 50  # the fork pool's children inherit it; spawned ones import the module afresh",
     "@pattern\ndef pools_in_a_node_over_notebook_and_module_helpers():\n    return ys([pooled], xs=[1, 2])"],
    # a spawn pool over a helper defined in the notebook: the spawned child cannot find it
    ["def square(v):\n    return v * v",
     "@node(output_name='y')\ndef spawned_squares(x):\n"
     "    ctx = multiprocessing.get_context('spawn')\n"
     "    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:\n"
     "        try:\n"
     "            return list(pool.map(square, range(x)))\n"
     "        except Exception as exc:\n"
     "            return type(exc).__name__",
     "@pattern\ndef spawn_pool_over_a_notebook_helper():\n    return ys([spawned_squares], xs=[2])"],
]


def main(executor: str) -> None:
    env = {**os.environ, "CORPUS_EXECUTOR": executor}
    km, kc = start_new_kernel(kernel_name="python3", cwd=os.getcwd(), env=env)
    try:
        for cells in [SETUP, *PATTERNS]:
            for cell in cells:
                reply = kc.execute_interactive(cell, timeout=600, output_hook=show)
                if reply["content"]["status"] != "ok":
                    print(f"cell failed: {cell!r}\n{reply['content'].get('traceback')}", file=sys.stderr)
        kc.execute_interactive("corpus.close()", timeout=120, output_hook=show)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def show(msg: dict) -> None:
    """The kernel's output: outcome lines to stdout, the rest (and errors) to stderr."""
    content = msg["content"]
    if msg["msg_type"] == "stream":
        for line in content["text"].splitlines():
            print(line, file=sys.stdout if line.startswith("@corpus ") else sys.stderr, flush=True)
    elif msg["msg_type"] == "error":
        print("\n".join(content["traceback"]), file=sys.stderr)


main(sys.argv[1])
