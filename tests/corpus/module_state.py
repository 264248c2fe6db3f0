# Module state a node reads, set or changed by the script at run time: each pattern writes the
# user's module as a file beside the script, imports it, changes its state the way users do and
# runs the pipeline. Run as `python - EXECUTOR < module_state.py` in an empty folder.
import builtins
import enum
import functools
import json
import sqlite3
import sys
import threading

import numpy as np
import pandas as pd
import wrapt

import corpus
from corpus import pattern, write
from hardy import Pipeline, node

engine = corpus.engine()
XS = [1, 2, 3]
SCRIPT_OFFSET = 40  # read by a module through `import __main__`


def ys(nodes, xs=XS, output="y"):
    out = corpus.pipeline(nodes, engine).map(inputs={"x": xs}, map_over="x")
    return [o[output] for o in out]


@pattern
def dict_filled_from_argv():
    write("argv_steps.py", """
        from hardy import node
        SETTINGS = {}

        @node(output_name="y")
        def scaled(x):
            return x * SETTINGS.get("scale", 1)
    """)
    import argv_steps
    sys.argv += ["--scale", "10"]
    argv_steps.SETTINGS["scale"] = int(sys.argv[sys.argv.index("--scale") + 1])
    return ys([argv_steps.scaled])


@pattern
def dict_filled_from_a_config_file():
    write("config.json", '{"offset": 7, "label": "from-file"}')
    write("cfg_steps.py", """
        from hardy import node
        CONFIG = {"offset": 0, "label": "default"}

        @node(output_name="y")
        def labelled(x):
            return f"{CONFIG['label']}:{x + CONFIG['offset']}"
    """)
    import cfg_steps
    with open("config.json") as f:
        cfg_steps.CONFIG.update(json.load(f))
    return ys([cfg_steps.labelled])


@pattern
def list_appended_at_run_time():
    write("list_steps.py", """
        from hardy import node
        STOPWORDS = ["the"]

        @node(output_name="y")
        def kept(x):
            words = ["the", "a", "cat", "an"][: x + 1]
            return [w for w in words if w not in STOPWORDS]
    """)
    import list_steps
    list_steps.STOPWORDS.extend(["a", "an"])
    return ys([list_steps.kept])


@pattern
def set_filled_at_run_time():
    write("set_steps.py", """
        from hardy import node
        ALLOWED = set()

        @node(output_name="y")
        def allowed(x):
            return x in ALLOWED
    """)
    import set_steps
    set_steps.ALLOWED.update({1, 3})
    return ys([set_steps.allowed])


@pattern
def numpy_weights_rebound():
    write("np_steps.py", """
        import numpy as np
        from hardy import node
        WEIGHTS = np.ones(3)

        @node(output_name="y")
        def weighted(x):
            return float(WEIGHTS.sum() * x)
    """)
    import np_steps
    np_steps.WEIGHTS = np.full(3, 5.0)
    return ys([np_steps.weighted])


@pattern
def numpy_array_written_in_place():
    write("npin_steps.py", """
        import numpy as np
        from hardy import node
        WEIGHTS = np.ones(4)

        @node(output_name="y")
        def weighted(x):
            return (WEIGHTS * x).tolist()
    """)
    import npin_steps
    npin_steps.WEIGHTS[1:3] = 2.5
    npin_steps.WEIGHTS *= 2
    return ys([npin_steps.weighted])


@pattern
def big_array_rebound():
    write("big_steps.py", """
        import numpy as np
        from hardy import node
        TABLE = np.zeros(10)

        @node(output_name="y")
        def look_up(x):
            return [float(TABLE[x * 1000]), float(TABLE.sum()), len(TABLE)]
    """)
    import big_steps
    big_steps.TABLE = np.arange(200_000, dtype=np.float64)  # 1.6 MB: travels when a worker asks
    return ys([big_steps.look_up])


@pattern
def big_array_written_in_place():
    write("bigin_steps.py", """
        import numpy as np
        from hardy import node
        TABLE = np.arange(100_000, dtype=np.float64)

        @node(output_name="y")
        def look_up(x):
            return [float(TABLE[x]), float(TABLE.sum())]
    """)
    import bigin_steps
    bigin_steps.TABLE[2] = -1e6
    return ys([bigin_steps.look_up])


@pattern
def big_array_changed_between_two_maps():
    write("bigtwice_steps.py", """
        import numpy as np
        from hardy import node
        TABLE = np.ones(50_000)

        @node(output_name="y")
        def total(x):
            return float(TABLE.sum()) + x
    """)
    import bigtwice_steps
    first = ys([bigtwice_steps.total])
    bigtwice_steps.TABLE[:10] = 100.0
    second = ys([bigtwice_steps.total])
    bigtwice_steps.TABLE = np.zeros(70_000)
    return [first, second, ys([bigtwice_steps.total])]


@pattern
def big_array_rebound_before_each_of_ten_maps():
    write("bigten_steps.py", """
        import numpy as np
        from hardy import node
        TABLE = np.zeros(10)

        @node(output_name="y")
        def total(x):
            return float(TABLE.sum()) + x
    """)
    import bigten_steps
    answers = []
    for k in range(10):  # a parameter sweep: the script loads the next table before each map
        bigten_steps.TABLE = np.full(100_000, float(k))
        answers.append(ys([bigten_steps.total], xs=[1, 2, 3, 4]))
    return answers


@pattern
def pandas_frame_rebound():
    write("pd_steps.py", """
        import pandas as pd
        from hardy import node
        PRICES = pd.DataFrame({"item": [1, 2, 3], "price": [0.0, 0.0, 0.0]})

        @node(output_name="y")
        def price(x):
            return float(PRICES.loc[PRICES["item"] == x, "price"].iloc[0])
    """)
    import pd_steps
    pd_steps.PRICES = pd.DataFrame({"item": [1, 2, 3], "price": [9.5, 8.25, 7.0]})
    return ys([pd_steps.price])


@pattern
def pandas_frame_changed_in_place():
    write("pdin_steps.py", """
        import pandas as pd
        from hardy import node
        PRICES = pd.DataFrame({"item": [1, 2, 3], "price": [1.0, 2.0, 3.0]})

        @node(output_name="y")
        def price(x):
            row = PRICES[PRICES["item"] == x]
            return float(row["price"].iloc[0]) + float(row.get("tax", pd.Series([0.0])).iloc[0])
    """)
    import pdin_steps
    pdin_steps.PRICES.loc[0, "price"] = 100.0
    pdin_steps.PRICES["tax"] = [0.5, 0.25, 0.125]
    return ys([pdin_steps.price])


@pattern
def dataclass_config_mutated():
    write("dc_steps.py", """
        from dataclasses import dataclass, field
        from hardy import node

        @dataclass
        class Config:
            threshold: float = 0.5
            tags: list = field(default_factory=list)

        CONFIG = Config()

        @node(output_name="y")
        def classify(x):
            return ("high" if x / 3 > CONFIG.threshold else "low", CONFIG.tags)
    """)
    import dc_steps
    dc_steps.CONFIG.threshold = 0.9
    dc_steps.CONFIG.tags.append("tuned")
    return ys([dc_steps.classify])


@pattern
def dataclass_config_rebound():
    write("dcr_steps.py", """
        from dataclasses import dataclass
        from hardy import node

        @dataclass(frozen=True)
        class Config:
            threshold: float = 0.5

        CONFIG = Config()

        @node(output_name="y")
        def classify(x):
            return x / 3 > CONFIG.threshold
    """)
    import dcr_steps
    dcr_steps.CONFIG = dcr_steps.Config(threshold=0.1)
    return ys([dcr_steps.classify])


@pattern
def plain_object_attribute_set():
    write("obj_steps.py", """
        from hardy import node

        class Settings:
            def __init__(self):
                self.mode = "train"

        SETTINGS = Settings()

        @node(output_name="y")
        def moded(x):
            return f"{SETTINGS.mode}-{x}"
    """)
    import obj_steps
    obj_steps.SETTINGS.mode = "eval"
    return ys([obj_steps.moded])


@pattern
def class_attribute_changed():
    write("cls_steps.py", """
        from hardy import node

        class Scaler:
            factor = 2

            def apply(self, x):
                return x * self.factor

        @node(output_name="y")
        def scaled(x):
            return Scaler().apply(x)
    """)
    import cls_steps
    cls_steps.Scaler.factor = 30
    return ys([cls_steps.scaled])


@pattern
def class_attribute_dict_filled():
    write("clsd_steps.py", """
        from hardy import node

        class Registry:
            handlers = {}

        @node(output_name="y")
        def handled(x):
            return Registry.handlers.get(x, "none")
    """)
    import clsd_steps
    clsd_steps.Registry.handlers[2] = "two"
    return ys([clsd_steps.handled])


@pattern
def global_counter_read_by_a_node():
    write("counter_steps.py", """
        from hardy import node
        CALLS = 0

        def bump():
            global CALLS
            CALLS += 1

        @node(output_name="y")
        def stamped(x):
            return (x, CALLS)
    """)
    import counter_steps
    for _ in range(5):
        counter_steps.bump()
    first = ys([counter_steps.stamped])
    counter_steps.bump()
    return [first, ys([counter_steps.stamped])]


@pattern
def nested_dict_changed_deep_inside():
    write("deep_steps.py", """
        from hardy import node
        SETTINGS = {"model": {"layers": [{"units": 8}, {"units": 16}], "name": "small"}}

        @node(output_name="y")
        def units(x):
            return SETTINGS["model"]["layers"][1]["units"] * x
    """)
    import deep_steps
    first = ys([deep_steps.units])
    deep_steps.SETTINGS["model"]["layers"][1]["units"] = 64
    return [first, ys([deep_steps.units])]


@pattern(refused=("ReplicaError", ["lock_steps.LOCK"]))
def unpicklable_value_set_at_run_time():
    write("lock_steps.py", f"""
        from hardy import node
        LOCK = None

        @node(output_name="y")
        def guarded(x):
            open({corpus.ran("unpicklable_value_set_at_run_time")!r}, "a").close()
            with LOCK:
                return x + 1
    """)
    import lock_steps
    lock_steps.LOCK = threading.Lock()
    return ys([lock_steps.guarded])


@pattern(refused=("ReplicaError", ["db_steps.DB"]))
def connection_opened_at_run_time():
    write("db_steps.py", f"""
        from hardy import node
        DB = None

        @node(output_name="y")
        def looked_up(x):
            open({corpus.ran("connection_opened_at_run_time")!r}, "a").close()
            return DB.execute("select v from t where k = ?", (x,)).fetchone()[0]
    """)
    import db_steps
    db_steps.DB = sqlite3.connect(":memory:", check_same_thread=False)
    db_steps.DB.execute("create table t (k int, v text)")
    db_steps.DB.executemany("insert into t values (?, ?)", [(1, "one"), (2, "two"), (3, "three")])
    return ys([db_steps.looked_up])


@pattern
def unpicklable_value_made_at_import_and_untouched():
    write("implock_steps.py", """
        import threading
        from hardy import node
        LOCK = threading.Lock()
        TOTALS = {"n": 3}

        @node(output_name="y")
        def guarded(x):
            with LOCK:
                return x * TOTALS["n"]
    """)
    import implock_steps
    implock_steps.TOTALS["n"] = 4
    return ys([implock_steps.guarded])


@pattern
def function_valued_global_rebound():
    write("fn_steps.py", """
        from hardy import node

        def relu(v):
            return max(v, 0)

        def leaky(v):
            return v if v > 0 else v / 100

        ACTIVATION = relu

        @node(output_name="y")
        def activated(x):
            return ACTIVATION(x - 2)
    """)
    import fn_steps
    fn_steps.ACTIVATION = fn_steps.leaky
    return ys([fn_steps.activated])


@pattern
def function_valued_global_rebound_to_a_script_lambda():
    write("fnl_steps.py", """
        from hardy import node
        TRANSFORM = abs

        @node(output_name="y")
        def transformed(x):
            return TRANSFORM(x - 2)
    """)
    import fnl_steps
    fnl_steps.TRANSFORM = lambda v: v * 1000 + 1
    return ys([fnl_steps.transformed])


@pattern
def helper_rebound_to_another_modules_function():
    write("other_helpers.py", """
        def helper2(x):
            return x ** 3
    """)
    write("reb_steps.py", """
        from hardy import node

        def helper(x):
            return x + 1

        @node(output_name="y")
        def helped(x):
            return helper(x)
    """)
    import other_helpers
    import reb_steps
    reb_steps.helper = other_helpers.helper2
    return ys([reb_steps.helped])


@pattern
def registry_dict_of_functions_filled_at_run_time():
    write("reg_steps.py", """
        from hardy import node
        REGISTRY = {"double": lambda v: 2 * v}

        @node(output_name="y")
        def dispatched(x):
            return REGISTRY.get("custom", REGISTRY["double"])(x)
    """)
    import reg_steps

    def custom(v):
        return v - 100

    reg_steps.REGISTRY["custom"] = custom
    return ys([reg_steps.dispatched])


@pattern
def attribute_of_a_submodule_imported_as_an_alias():
    write("alias_pkg/__init__.py", "")
    write("alias_pkg/sub.py", """
        FACTOR = 1
        TABLE = {"a": 1}
    """)
    write("alias_steps.py", """
        import alias_pkg.sub as s
        from hardy import node

        @node(output_name="y")
        def scaled(x):
            return x * s.FACTOR + s.TABLE["a"]
    """)
    import alias_pkg.sub
    import alias_steps
    alias_pkg.sub.FACTOR = 7
    alias_pkg.sub.TABLE["a"] = 1000
    return ys([alias_steps.scaled])


@pattern
def attribute_reached_through_a_package_chain():
    write("chain_pkg/__init__.py", "from . import inner")
    write("chain_pkg/inner.py", """
        LIMITS = {"max": 10}
    """)
    write("chain_steps.py", """
        import chain_pkg
        from hardy import node

        @node(output_name="y")
        def clipped(x):
            return min(x * 10, chain_pkg.inner.LIMITS["max"])
    """)
    import chain_pkg
    import chain_steps
    chain_pkg.inner.LIMITS["max"] = 25
    return ys([chain_steps.clipped])


@pattern
def state_read_by_a_helper_in_another_module():
    write("state_helpers.py", """
        VOCAB = {}

        def encode(word):
            return VOCAB.get(word, -1)
    """)
    write("hm_steps.py", """
        import state_helpers
        from hardy import node

        @node(output_name="y")
        def encoded(x):
            return state_helpers.encode(["a", "b", "c"][x - 1])
    """)
    import hm_steps
    import state_helpers
    state_helpers.VOCAB.update({"a": 10, "c": 30})
    return ys([hm_steps.encoded])


@pattern
def closure_over_a_value():
    write("clo_steps.py", """
        from hardy import node

        def make_scaler(factor):
            @node(output_name="y")
            def scaled(x):
                return x * factor
            return scaled
    """)
    import clo_steps
    return ys([clo_steps.make_scaler(11)])


@pattern
def closure_over_a_list_changed_later():
    write("clol_steps.py", """
        from hardy import node

        def make_filter(blocked):
            @node(output_name="y")
            def allowed(x):
                return x not in blocked
            return allowed
    """)
    import clol_steps
    blocked = [1]
    allowed = clol_steps.make_filter(blocked)
    first = ys([allowed])
    blocked.append(3)
    return [first, ys([allowed])]


@pattern
def default_argument_dict_changed_in_place():
    write("dflt_steps.py", """
        from hardy import node
        TABLE = {"k": 1}

        @node(output_name="y")
        def looked_up(x, table=TABLE):
            return x * table["k"]
    """)
    import dflt_steps
    first = ys([dflt_steps.looked_up])
    dflt_steps.TABLE["k"] = 9
    return [first, ys([dflt_steps.looked_up])]


@pattern
def default_argument_of_a_helper_changed_in_place():
    write("dflth_steps.py", """
        from hardy import node
        UNITS = ["m"]

        def fmt(v, units=UNITS):
            return f"{v}{units[-1]}"

        @node(output_name="y")
        def formatted(x):
            return fmt(x)
    """)
    import dflth_steps
    dflth_steps.UNITS.append("km")
    return ys([dflth_steps.formatted])


SCRIPT_SETTINGS = {"add": 0}


@node(output_name="y")
def script_node(x):
    return x + SCRIPT_SETTINGS["add"]


@pattern
def script_global_dict_changed_between_maps():
    settings = SCRIPT_SETTINGS
    first = ys([script_node])
    settings["add"] = 5
    return [first, ys([script_node])]


SCRIPT_SCALE = 3


@node(output_name="y")
def script_node_defining_a_class(x):
    class Local:  # (a class body reads the script's globals by name, not as a function does)
        SCRIPT_SCALE = SCRIPT_SCALE  # (the script's, read before the class binds its own)
        r = np.sqrt(4)
    return x * Local.SCRIPT_SCALE * Local.r


@pattern
def script_node_whose_body_defines_a_class_reading_script_globals():
    return ys([script_node_defining_a_class])


@pattern
def dynamic_getattr_on_the_module():
    write("dyn_steps.py", """
        import sys
        from hardy import node
        MODE_SCALE = 1

        @node(output_name="y")
        def scaled(x):
            return x * getattr(sys.modules[__name__], "MODE_SCALE")
    """)
    import dyn_steps
    dyn_steps.MODE_SCALE = 4
    return ys([dyn_steps.scaled])


@pattern
def module_state_set_through_a_setup_function():
    write("setup_steps.py", """
        from hardy import node
        _MODEL = None

        def setup(path):
            global _MODEL
            with open(path) as f:
                _MODEL = {"bias": float(f.read())}

        @node(output_name="y")
        def predicted(x):
            if _MODEL is None:
                return "not set up"
            return x + _MODEL["bias"]
    """)
    write("bias.txt", "0.25")
    import setup_steps
    setup_steps.setup("bias.txt")
    return ys([setup_steps.predicted])


@pattern
def value_deleted_from_the_module():
    write("del_steps.py", """
        from hardy import node
        OVERRIDE = 5

        @node(output_name="y")
        def maybe(x):
            return globals().get("OVERRIDE", 0) + x
    """)
    import del_steps
    del del_steps.OVERRIDE
    return ys([del_steps.maybe])


@pattern
def instance_method_reads_changed_instance_state():
    write("inst_steps.py", """
        from hardy import node

        class Tokenizer:
            def __init__(self):
                self.vocab = {"a": 1}

            def encode(self, text):
                return [self.vocab.get(ch, 0) for ch in text]

        TOKENIZER = Tokenizer()

        @node(output_name="y")
        def encoded(x):
            return TOKENIZER.encode("abc"[:x])
    """)
    import inst_steps
    inst_steps.TOKENIZER.vocab.update({"b": 2, "c": 3})
    return ys([inst_steps.encoded])


@pattern
def enum_like_constant_tuple_rebound():
    write("tup_steps.py", """
        from hardy import node
        LABELS = ("neg", "pos")

        @node(output_name="y")
        def labelled(x):
            return LABELS[x % 2]
    """)
    import tup_steps
    tup_steps.LABELS = ("even", "odd")
    return ys([tup_steps.labelled])


@pattern
def array_view_of_a_module_array_written():
    write("view_steps.py", """
        import numpy as np
        from hardy import node
        BASE = np.zeros(6)
        HEAD = BASE[:3]

        @node(output_name="y")
        def head(x):
            return float(HEAD[x - 1])
    """)
    import view_steps
    view_steps.BASE[:] = np.arange(6) * 10  # HEAD is a view: written through BASE
    return ys([view_steps.head])


@pattern
def big_pandas_frame_rebound():
    write("bigpd_steps.py", """
        import pandas as pd
        from hardy import node
        FRAME = pd.DataFrame({"v": [0.0]})

        @node(output_name="y")
        def stats(x):
            return [float(FRAME["v"].sum()), len(FRAME), float(FRAME["v"].iloc[x])]
    """)
    import bigpd_steps
    bigpd_steps.FRAME = pd.DataFrame({"v": np.linspace(0, 1, 30_000), "w": np.arange(30_000)})
    return ys([bigpd_steps.stats])


@pattern
def value_deleted_and_read_by_name():
    write("delname_steps.py", """
        from hardy import node
        OVERRIDE = 5

        @node(output_name="y")
        def maybe(x):
            try:
                return OVERRIDE + x
            except NameError:
                return -x
    """)
    import delname_steps
    del delname_steps.OVERRIDE
    return ys([delname_steps.maybe])


@pattern
def value_added_to_the_module_at_run_time():
    write("added_steps.py", """
        from hardy import node

        @node(output_name="y")
        def maybe(x):
            try:
                return EXTRA + x
            except NameError:
                return -x
    """)
    import added_steps
    added_steps.EXTRA = 100
    return ys([added_steps.maybe])


@pattern
def state_changed_between_map_and_run():
    write("mr_steps.py", """
        from hardy import node
        STATE = {"k": 1}

        @node(output_name="y")
        def times(x):
            return x * STATE["k"]
    """)
    import mr_steps
    p = Pipeline(nodes=[mr_steps.times], engine=engine)
    first = p.run(inputs={"x": 2})["y"]
    mr_steps.STATE["k"] = 3
    second = p.map(inputs={"x": XS}, map_over="x")
    mr_steps.STATE["k"] = 5
    return [first, second, p.run(inputs={"x": 2})["y"]]


@pattern
def numpy_global_seed_set_by_the_script():
    @node(output_name="y")
    def drawn(x):
        return round(float(np.random.random()), 12)

    np.random.seed(1234)
    return ys([drawn], xs=[1])


@pattern
def deque_filled_at_run_time():
    write("dq_steps.py", """
        import collections
        from hardy import node
        RECENT = collections.deque(maxlen=3)

        @node(output_name="y")
        def with_recent(x):
            return [x, *RECENT]
    """)
    import dq_steps
    dq_steps.RECENT.extend(["a", "b"])
    return ys([dq_steps.with_recent])


@pattern
def generator_object_rebound():
    write("genr_steps.py", """
        import numpy as np
        from hardy import node
        RNG = np.random.default_rng(0)

        @node(output_name="y")
        def first_draw(x):
            return [x, round(float(np.random.default_rng(RNG.bit_generator.state["state"]["state"] % 1000).random()), 12)]
    """)
    import genr_steps
    genr_steps.RNG = np.random.default_rng(99)
    return ys([genr_steps.first_draw])


@pattern
def function_attribute_set_at_run_time():
    write("fattr_steps.py", """
        from hardy import node

        def lookup(key):
            return getattr(lookup, "table", {}).get(key, "missing")

        @node(output_name="y")
        def looked_up(x):
            return lookup(x)
    """)
    import fattr_steps
    fattr_steps.lookup.table = {1: "one", 3: "three"}
    return ys([fattr_steps.looked_up])


@pattern
def class_attribute_changed_between_maps():
    write("clsb_steps.py", """
        from hardy import node

        class Model:
            threshold = 0.5

        @node(output_name="y")
        def decided(x):
            return x / 4 > Model.threshold
    """)
    import clsb_steps
    first = ys([clsb_steps.decided])
    clsb_steps.Model.threshold = 0.1
    return [first, ys([clsb_steps.decided])]


@pattern
def object_attribute_set_between_maps():
    write("objb_steps.py", """
        from hardy import node

        class Settings:
            mode = "train"

        SETTINGS = Settings()

        @node(output_name="y")
        def moded(x):
            return f"{SETTINGS.mode}{x}"
    """)
    import objb_steps
    first = ys([objb_steps.moded])
    objb_steps.SETTINGS.mode = "eval"
    return [first, ys([objb_steps.moded])]


@pattern
def read_only_array_rewritten_between_maps():
    write("ro_steps.py", """
        import numpy as np
        from hardy import node
        LUT = np.arange(4.0)
        LUT.setflags(write=False)

        @node(output_name="y")
        def mapped(x):
            return float(LUT[x])
    """)
    import ro_steps
    first = ys([ro_steps.mapped])
    ro_steps.LUT.setflags(write=True)
    ro_steps.LUT[:] = [0.0, -1.0, -2.0, -3.0]  # a calibration step rewrites the table
    ro_steps.LUT.setflags(write=False)
    return [first, ys([ro_steps.mapped])]


@pattern
def helper_defaults_changed_between_maps():
    write("hdf_steps.py", """
        from hardy import node

        def rounded(v, digits=0):
            return round(v / 7, digits)

        @node(output_name="y")
        def approx(x):
            return rounded(x)
    """)
    import hdf_steps
    first = ys([hdf_steps.approx])
    hdf_steps.rounded.__defaults__ = (3,)
    return [first, ys([hdf_steps.approx])]


@pattern
def lru_cached_helper_called_before_its_table_changed():
    write("lru_steps.py", """
        import functools
        from hardy import node
        TABLE = {1: "old", 2: "old", 3: "old"}

        @functools.lru_cache(maxsize=None)
        def label(k):
            return TABLE[k]

        @node(output_name="y")
        def labelled(x):
            return label(x)
    """)
    import lru_steps
    lru_steps.label(1)  # the script warms the cache for one key
    lru_steps.TABLE.update({1: "new", 2: "new", 3: "new"})
    return ys([lru_steps.labelled])


@pattern
def plugin_registered_by_importing_another_module():
    write("plug_steps.py", """
        from hardy import node
        HANDLERS = {}

        def register(name):
            def wrap(fn):
                HANDLERS[name] = fn
                return fn
            return wrap

        @node(output_name="y")
        def handled(x):
            return sorted(HANDLERS) + [HANDLERS["double"](x) if "double" in HANDLERS else None]
    """)
    write("plug_double.py", """
        from plug_steps import register

        @register("double")
        def double(x):
            return 2 * x
    """)
    import plug_double  # noqa: F401 -- imported for its registration, as plugins are
    import plug_steps
    return ys([plug_steps.handled])


@pattern
def synthetic_module_put_in_sys_modules():
    import types
    write("synth_steps.py", """
        from hardy import node

        @node(output_name="y")
        def configured(x):
            import run_config
            return x * run_config.SCALE
    """)
    config = types.ModuleType("run_config")
    config.SCALE = 6
    sys.modules["run_config"] = config  # made by the script, no file behind it
    import synth_steps
    try:
        return ys([synth_steps.configured])
    finally:
        del sys.modules["run_config"]


@pattern
def big_vocabulary_list_filled_at_run_time():
    write("vocab_steps.py", """
        from hardy import node
        VOCAB = []

        @node(output_name="y")
        def encoded(x):
            return [len(VOCAB), VOCAB.index(f"word{x * 1000}")]
    """)
    import vocab_steps
    vocab_steps.VOCAB.extend(f"word{k}" for k in range(20_000))  # about 250 KB pickled
    return ys([vocab_steps.encoded])


@pattern
def module_reads_the_scripts_main():
    write("main_steps.py", """
        import __main__
        from hardy import node

        @node(output_name="y")
        def from_main(x):
            return x + __main__.SCRIPT_OFFSET
    """)
    import main_steps
    return ys([main_steps.from_main])


@pattern
def class_attribute_changed_under_an_instance_made_at_import():
    write("atimport_steps.py", """
        from hardy import node

        class Model:
            threshold = 0.5

            def predict(self, x):
                return x / 4 > self.threshold

        MODEL = Model()

        @node(output_name="y")
        def decided(x):
            return MODEL.predict(x)
    """)
    import atimport_steps
    first = ys([atimport_steps.decided])
    atimport_steps.Model.threshold = 0.1
    return [first, ys([atimport_steps.decided])]


def _scaled_by_ten(self, x):
    return x * 10


@pattern
def method_replaced_on_the_class_of_an_instance_made_at_import():
    write("meth_steps.py", """
        import abc

        from hardy import node

        class Base(abc.ABC):
            offset = 1

            @abc.abstractmethod
            def scale(self, x): ...

            def apply(self, x):
                return self.scale(x) + self.offset

        class Doubler(Base):
            def scale(self, x):
                return 2 * x

            def apply(self, x):
                return -super().apply(x)

        MODEL = Doubler()

        @node(output_name="y")
        def applied(x):
            return MODEL.apply(x)
    """)
    import meth_steps
    meth_steps.Doubler.scale = _scaled_by_ten  # the script's function, on the module's class
    meth_steps.Base.offset = 5
    return ys([meth_steps.applied])


@pattern
def class_changed_and_imported_by_another_module():
    write("kind_steps.py", """
        class Item:
            unit = "cm"

            def label(self, x):
                return f"{x}{self.unit}"

        DEFAULT = Item()
    """)
    write("kind_users.py", """
        from hardy import node
        from kind_steps import DEFAULT, Item

        @node(output_name="y")
        def labelled(x):
            return [isinstance(DEFAULT, Item), Item().label(x), DEFAULT.label(x)]
    """)
    import kind_steps
    import kind_users
    kind_steps.Item.unit = "mm"
    return ys([kind_users.labelled])


@pattern
def stdlib_array_written_in_place_between_maps():
    write("stdarr_steps.py", """
        import array

        from hardy import node

        BUF = array.array("d", [1.0, 2.0])

        @node(output_name="y")
        def summed(x):
            return x + sum(BUF)
    """)
    import stdarr_steps
    first = ys([stdarr_steps.summed])
    stdarr_steps.BUF[0] = 100.0
    return [first, ys([stdarr_steps.summed])]


@pattern(refused=("ReplicaError", ["cty_steps.BUF"]))
def ctypes_array_written_in_place():
    write("cty_steps.py", """
        import ctypes

        from hardy import node

        BUF = (ctypes.c_int * 2)(1, 2)

        @node(output_name="y")
        def read(x):
            return [x, list(BUF)]
    """)
    import cty_steps
    cty_steps.BUF[0] = 9
    return ys([cty_steps.read])


def _plus_a_thousand(self, x):
    return x * self.scale + 1000


@pattern
def method_replaced_on_a_slotted_class_of_an_instance_made_at_import():
    write("slot_steps.py", """
        import dataclasses

        from hardy import node

        class Slotted:
            __slots__ = ("scale",)

            def __init__(self):
                self.scale = 2

            def apply(self, x):
                return x * self.scale

        @dataclasses.dataclass(slots=True)
        class Frozen:
            scale: int = 3

            def apply(self, x):
                return x * self.scale

        ONE, TWO = Slotted(), Frozen()

        @node(output_name="y")
        def applied(x):
            return [ONE.apply(x), TWO.apply(x)]
    """)
    import slot_steps
    first = ys([slot_steps.applied])
    slot_steps.Slotted.apply = _plus_a_thousand
    slot_steps.Frozen.apply = _plus_a_thousand
    return [first, ys([slot_steps.applied])]


@pattern
def nested_class_changed_between_maps():
    write("nest_steps.py", """
        from hardy import node

        class Outer:
            scale = 1

            class Base:
                offset = 0

                def apply(self, x):
                    return x + self.offset

            class Inner(Base):
                factor = 2

                def apply(self, x):
                    return super().apply(x) * self.factor

                class Deep:
                    bonus = 0

            DEFAULT = None

        Outer.Inner.home = Outer
        Outer.DEFAULT = Outer.Inner()
        HELPER = Outer.Inner()

        @node(output_name="y")
        def computed(x):
            same = [isinstance(HELPER, Outer.Inner), isinstance(Outer.DEFAULT, Outer.Inner),
                    Outer.Inner.home is Outer, issubclass(Outer.Inner, Outer.Base)]
            return [Outer.Inner().apply(x), HELPER.apply(x), Outer.DEFAULT.apply(x), Outer.Inner.Deep.bonus,
                    Outer.scale, same]
    """)
    import nest_steps
    first = ys([nest_steps.computed])
    nest_steps.Outer.Inner.factor = 10
    nest_steps.Outer.Base.offset = 100
    nest_steps.Outer.Inner.Deep.bonus = 7
    return [first, ys([nest_steps.computed])]


@pattern
def nested_class_holding_a_lock_changed():
    write("nlock_steps.py", """
        import threading

        from hardy import node

        class Outer:
            class Guarded:
                lock = threading.Lock()
                factor = 2

        @node(output_name="y")
        def guarded(x):
            with Outer.Guarded.lock:
                return x * Outer.Guarded.factor
    """)
    import nlock_steps
    first = ys([nlock_steps.guarded])
    nlock_steps.Outer.Guarded.factor = 20
    return [first, ys([nlock_steps.guarded])]


@pattern(refused=("ReplicaError", ["nlockset_steps.Outer.Guarded.lock"]))
def lock_set_on_a_nested_class_at_run_time():
    write("nlockset_steps.py", f"""
        from hardy import node

        class Outer:
            class Guarded:
                lock = None

        @node(output_name="y")
        def guarded(x):
            open({corpus.ran("lock_set_on_a_nested_class_at_run_time")!r}, "a").close()
            with Outer.Guarded.lock:
                return x + 1
    """)
    import nlockset_steps
    nlockset_steps.Outer.Guarded.lock = threading.Lock()
    return ys([nlockset_steps.guarded])


@pattern
def class_changed_beside_a_nested_class_holding_a_lock():
    write("nlock2_steps.py", """
        import threading

        from hardy import node

        class Outer:
            scale = 1

            class Guarded:
                lock = threading.Lock()

        @node(output_name="y")
        def scaled(x):
            with Outer.Guarded.lock:
                return x * Outer.scale
    """)
    import nlock2_steps
    nlock2_steps.Outer.scale = 30
    return ys([nlock2_steps.scaled])


@pattern
def nested_classes_kept_beside_a_change():
    write("keep_steps.py", """
        import enum

        from hardy import node

        REGISTRY = []

        class Registered:
            def __init_subclass__(cls, **kwargs):
                super().__init_subclass__(**kwargs)
                REGISTRY.append(cls.__qualname__)

        class Meta(type):
            pass

        class Outer:
            scale = 1

            class Color(enum.Enum):
                RED = 1

            class Base:
                def apply(self, x):
                    return x + 1

            class Zchild(Base, Registered):
                def apply(self, x):
                    return super().apply(x) * 2

            class Made(metaclass=Meta):
                pass

            HANDLERS = {"child": Zchild}

        WEIGHTS = {Outer.Color.RED: 10}
        MADE = Outer.Made()

        @node(output_name="y")
        def computed(x):
            handler = Outer.HANDLERS["child"]()
            return [x * Outer.scale, WEIGHTS.get(Outer.Color.RED), isinstance(MADE, Outer.Made), handler.apply(x),
                    Outer.HANDLERS["child"] is Outer.Zchild, len(REGISTRY)]
    """)
    import keep_steps
    first = ys([keep_steps.computed])
    keep_steps.Outer.scale = 3
    return [first, ys([keep_steps.computed])]


@pattern
def abc_virtual_subclass_registered_at_run_time():
    write("abcreg_steps.py", """
        import abc

        from hardy import node

        class Scalar(abc.ABC):
            pass

        @node(output_name="y")
        def kind(x):
            return "scalar" if isinstance(x, Scalar) else "other"
    """)
    import abcreg_steps
    abcreg_steps.Scalar.register(int)
    return ys([abcreg_steps.kind])


def _area_times_a_hundred(self):
    return self.x * 100


@pattern
def cached_property_replaced_on_a_class():
    write("cprop_steps.py", """
        import functools

        from hardy import node

        class Shape:
            def __init__(self, x):
                self.x = x

            @functools.cached_property
            def area(self):
                return self.x * self.x

        @node(output_name="y")
        def measured(x):
            return Shape(x).area
    """)
    import functools

    import cprop_steps
    first = ys([cprop_steps.measured])
    cprop_steps.Shape.area = functools.cached_property(_area_times_a_hundred)
    cprop_steps.Shape.area.__set_name__(cprop_steps.Shape, "area")
    return [first, ys([cprop_steps.measured])]


@pattern
def bound_method_of_a_script_class_with_a_cached_property():
    # the class travels by value (it is the script's); on Python 3.11 its cached_property holds a lock
    import functools

    class Scaler:
        def __init__(self, base):
            self.base = base

        @functools.cached_property
        def factor(self):
            return self.base * 10

        def apply(self, x):
            return x * self.factor

    scaler = Scaler(2)
    first = ys([node(scaler.apply, output_name="y")])
    scaler.base = 3  # (the factor already cached on the instance stays 20, as in a plain loop)
    return [first, ys([node(Scaler(3).apply, output_name="y")])]


@pattern
def code_given_as_an_input_reads_module_state_set_at_run_time():
    # a transform (function, object, class, bound method) passed as an input, bound, or mapped over:
    # it runs its module's code in the worker, which must read the state the script set
    write("given_aug.py", """
        MEAN = 0.0
        TABLE = {"k": 0}

        def normalize(v):
            return v - MEAN + TABLE["k"]

        class Normalizer:
            def __call__(self, v):
                return v - MEAN

            def shift(self, v):
                return v + MEAN
    """)
    write("given_chain.py", """
        import functools

        import given_aug

        def through(v):  # (reaches given_aug's state through its own code)
            return given_aug.normalize(v)

        def call(v, f):
            return f(v)

        bound = functools.partial(call, f=given_aug.normalize)
    """)
    write("given_steps.py", """
        from hardy import node

        @node(output_name="y")
        def prep(x, transform):
            return transform(x)

        @node(output_name="y")
        def built(x, cls):
            return cls()(x)
    """)
    import given_aug
    import given_chain
    import given_steps

    def run(node_, **inputs):
        p = corpus.pipeline([node_], engine)
        return [o["y"] for o in p.map(inputs={"x": [1.0, 2.0], **inputs}, map_over="x")]

    given_aug.MEAN = 10.0
    seen = [run(given_steps.prep, transform=given_aug.normalize), run(given_steps.prep, transform=given_aug.Normalizer()),
            run(given_steps.built, cls=given_aug.Normalizer),
            run(given_steps.prep, transform=given_aug.Normalizer().shift),
            run(given_steps.prep, transform=given_chain.through), run(given_steps.prep, transform=given_chain.bound),
            run(given_steps.prep, transform=lambda v: given_aug.normalize(v) * 2)]
    given_aug.MEAN = 20.0  # between two maps of one pipeline: rebound, and a dict changed in place
    given_aug.TABLE["k"] = 100
    seen.append(run(given_steps.prep, transform=given_aug.normalize))
    mapped = corpus.pipeline([given_steps.prep], engine).map(
        inputs={"x": 1.0, "transform": [given_aug.normalize, given_aug.Normalizer()]}, map_over="transform")
    bound = corpus.pipeline([given_steps.prep], engine).bind(transform=given_aug.normalize).run(inputs={"x": 1.0})
    return [seen, [o["y"] for o in mapped], bound["y"]]


@pattern
def singledispatch_implementation_registered_at_run_time():
    write("disp_steps.py", """
        import functools

        from hardy import node

        @functools.singledispatch
        def shown(v):
            return f"obj:{v}"

        def use_fancy_ints():
            @shown.register(int)
            def _(v):
                return f"int:{v}"

        @node(output_name="y")
        def formatted(x):
            return shown(x)
    """)
    import disp_steps
    first = ys([disp_steps.formatted])
    disp_steps.use_fancy_ints()
    return [first, ys([disp_steps.formatted])]


@pattern
def helper_defaults_changed_in_place_between_maps():
    write("dfip_steps.py", """
        import collections

        from hardy import node

        VOCAB = ["a"]
        Point = collections.namedtuple("Point", "x y", defaults=(0, 2))

        def encode(token, vocab=VOCAB):
            return vocab.index(token) if token in vocab else -1

        def rounded(v, *, digits=0):
            return round(v, digits)

        @node(output_name="y")
        def computed(x):
            return [encode("b"), rounded(1 / 7), Point(x).y]
    """)
    import dfip_steps
    first = ys([dfip_steps.computed])
    dfip_steps.VOCAB.append("b")
    dfip_steps.rounded.__kwdefaults__ = {"digits": 3}
    dfip_steps.Point.__new__.__defaults__ = (0, 20)
    return [first, ys([dfip_steps.computed])]


def _custom_attribute(name):
    if name.startswith("item_"):
        return f"custom-{name[5:]}"
    raise AttributeError(name)


@pattern
def module_getattr_set_at_run_time():
    write("mga_steps.py", """
        from hardy import node

        def __getattr__(name):
            if name.startswith("item_"):
                return f"default-{name[5:]}"
            raise AttributeError(name)

        @node(output_name="y")
        def looked_up(x):
            import mga_steps
            return getattr(mga_steps, f"item_{x}")
    """)
    import mga_steps
    mga_steps.__getattr__ = _custom_attribute
    return ys([mga_steps.looked_up])


@pattern
def enum_member_attribute_set_at_run_time():
    write("emem_steps.py", """
        import enum

        from hardy import node

        class Unit(enum.Enum):
            CM = "cm"
            MM = "mm"

            def __init__(self, symbol):
                self.factor = 1

            def scale(self, x):
                return x * self.factor

        DEFAULT = Unit.CM

        @node(output_name="y")
        def converted(x):
            return [DEFAULT.scale(x), Unit.MM.scale(x), DEFAULT is Unit.CM]
    """)
    import emem_steps
    first = ys([emem_steps.converted])
    emem_steps.Unit.CM.factor = 10
    return [first, ys([emem_steps.converted])]


def _legacy_int(v):
    return "legacy-int"


def _twice(x):
    return 2 * x


@pattern
def class_and_dispatcher_bound_under_two_names():
    write("twice_steps.py", """
        import functools

        from hardy import node

        class Model:
            factor = 1

            def apply(self, x):
                return x * self.factor

        LegacyModel = Model  # the old class kept under another name

        class Model:  # redefined: one qualified name, two classes
            factor = 2

            def apply(self, x):
                return x * self.factor + 1000

        @functools.singledispatch
        def shown(v):
            return "old"

        legacy_shown = shown

        @functools.singledispatch
        def shown(v):  # noqa: F811
            return "new"

        def handle(name, x):
            return handle.registry.get(name, lambda v: None)(x)

        handle.registry = {}
        handle.register = lambda name: lambda fn: handle.registry.setdefault(name, fn)

        @node(output_name="y")
        def used(x):
            return [Model().apply(x), LegacyModel().apply(x), shown(x), legacy_shown(x), handle("double", x)]
    """)
    import twice_steps
    first = ys([twice_steps.used])
    twice_steps.LegacyModel.factor = 10
    twice_steps.legacy_shown.register(int, _legacy_int)
    twice_steps.handle.register("double")(_twice)
    return [first, ys([twice_steps.used])]


@pattern
def state_behind_a_name_changed_between_maps():
    write("behind_steps.py", """
        import abc
        import collections
        import dataclasses
        import enum
        import functools

        from hardy import node

        @dataclasses.dataclass
        class Config:
            scale: int = 2

            def __post_init__(self):
                self.factor = self.scale * 10

        class Scaled:
            def __init__(self, fn):
                functools.update_wrapper(self, fn)
                self.fn, self.factor = fn, 2

            def __call__(self, x):
                return self.fn(x) * self.factor

        @Scaled
        def doubled(x):
            return x

        class Base:
            SCALE = 2

        class Model(Base):
            pass

        class Level(enum.IntEnum):
            LOW = 1

        class Scalar(abc.ABC):
            pass

        CONFIG = Config()
        TABLE = {"a": 1}
        lookup = TABLE.get
        SETTINGS = collections.ChainMap({}, {"scale": 2})
        Level.LOW.weight = 1

        @node(output_name="y")
        def read(x):
            return [x * CONFIG.factor, lookup("a"), doubled(x), x * Model.SCALE, SETTINGS["scale"],
                    Level.LOW.weight, isinstance(x, Scalar)]
    """)
    import behind_steps
    first = ys([behind_steps.read])
    behind_steps.CONFIG.factor = 7
    behind_steps.TABLE["a"] = 100
    behind_steps.doubled.factor = 10
    behind_steps.Model.SCALE = 10
    behind_steps.SETTINGS["scale"] = 10
    behind_steps.Level.LOW.weight = 5
    behind_steps.Scalar.register(int)
    return [first, ys([behind_steps.read])]




def normalize(v, *, scale=1.0):  # the script's own helper and node: they travel by value
    return v * scale


@node(output_name="y")
def normalized(x):
    return normalize(x)


class Token(str):
    pass


PAD = Token("<pad>")
PAD.id = 0


@node(output_name="y")
def padded(x):
    return [PAD.id] * x


@pattern
def keyword_default_changed_in_place():
    first = ys([normalized])
    normalize.__kwdefaults__["scale"] = 5.0
    return [first, ys([normalized])]


@pattern
def attribute_of_a_str_subclass_changed():
    first = ys([padded])
    PAD.id = 99
    return [first, ys([padded])]


@pattern
def sentinel_held_by_module_state_changed_at_run_time():
    source = """
        from hardy import node
        MISSING = object()
        DEFAULTS = {"lr": 0.1, "wd": MISSING}

        class Settings:
            wd = MISSING

        def get(table, key, default=MISSING):
            v = table.get(key, default)
            return "unset" if v is MISSING else v

        @node(output_name="y")
        def resolve(x):
            name = "wd" if x % 2 else "lr"
            return [DEFAULTS[name] is MISSING, getattr(Settings, name, None) is MISSING, get({"lr": x}, name)]
    """
    write("sentinel_steps.py", source)
    import sentinel_steps
    write("sentinel_steps.py", source.replace('"unset"', '"<unset>"'))  # edited, not reloaded: `get` travels
    first = ys([sentinel_steps.resolve])
    sentinel_steps.DEFAULTS["lr"] = 0.01
    sentinel_steps.Settings.lr = 0.01
    return [first, ys([sentinel_steps.resolve])]


# The script's own decorated nodes and state: a wrapt decorator (a proxy that poses as the function it
# wraps), a proxy of the script's own, lru_cache functions, an Enum member's attribute, names put into
# builtins. Each is the script's, so it travels by value.
WRAPT_FACTOR = 2


@wrapt.decorator
def scaled_by_factor(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * WRAPT_FACTOR


@scaled_by_factor
def wrapt_add_one(x):
    return x + 1


@pattern
def wrapt_decorator_on_a_script_node():
    return ys([node(wrapt_add_one, output_name="y")])


class Traced:
    """Poses as the function it wraps (its `__class__`), as mocks and lazy proxies do."""

    def __init__(self, func, k):
        self.func, self.k = func, k

    @property
    def __class__(self):
        return type(self.func)

    def __getattr__(self, name):
        return getattr(self.func, name)

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs) * self.k


def traced_base(x):
    return x + 1


TRACED_NODE = node(Traced(traced_base, 100), output_name="y")


@pattern
def proxy_posing_as_the_function_it_wraps():
    return ys([TRACED_NODE])


class Opaque(wrapt.ObjectProxy):
    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs) * 1000


OPAQUE = Opaque(traced_base)


def reads_opaque(x):
    open(corpus.ran("wrapt_proxy_that_does_not_pickle"), "a").close()
    return OPAQUE(x)


@pattern(refused=("PicklingError", ["reads_opaque", "Opaque", "__reduce__"]))
def wrapt_proxy_that_does_not_pickle():
    return ys([node(reads_opaque, output_name="y")])


@functools.lru_cache(maxsize=64)
def vocab_of(x):
    return list(range(x))


@functools.cache
def square_of(x):
    return x * x


@pattern
def lru_cached_functions_of_the_script_as_nodes():
    return [ys([node(vocab_of, output_name="y")]), ys([node(square_of, output_name="y")])]


class Grade(enum.Enum):
    LOW = 1
    HIGH = 2


Grade.HIGH.weight = 3


def graded(x):
    return [x * Grade.HIGH.weight, Grade(2) is Grade.HIGH, getattr(Grade.LOW, "weight", None)]


GRADED = node(graded, output_name="y")


@pattern
def enum_member_attribute_set_by_the_script():
    first = ys([GRADED])
    Grade.HIGH.weight = 5
    Grade.LOW.weight = 1
    return [first, ys([GRADED])]


def over_threshold(x):
    return [x > THRESHOLD, LABELS[x % 2]]  # noqa: F821  # put into builtins by the pattern


THRESHOLD_NODE = node(over_threshold, output_name="y")


@pattern
def names_put_into_builtins_by_the_script():
    builtins.THRESHOLD, builtins.LABELS = 1.5, ["even", "odd"]
    try:
        first = ys([THRESHOLD_NODE])
        builtins.THRESHOLD = 2.5
        builtins.LABELS[0] = "EVEN"
        return [first, ys([THRESHOLD_NODE])]
    finally:
        del builtins.THRESHOLD, builtins.LABELS


def guarded_by_a_builtin(x):
    open(corpus.ran("lock_put_into_builtins_by_the_script"), "a").close()
    with GUARD:  # noqa: F821  # put into builtins by the pattern
        return x + 1


@pattern(refused=("ReplicaError", ["builtins.GUARD"]))
def lock_put_into_builtins_by_the_script():
    builtins.GUARD = threading.Lock()
    try:
        return ys([node(guarded_by_a_builtin, output_name="y")])
    finally:
        del builtins.GUARD

def measured(x):
    import math  # (imported inside the node too: a module read there counts the same)
    return [math.sqrt(x), float(np.mean([x, 0])), json.dumps({"x": x})]


MEASURED = node(measured, output_name="y")


@pattern
def library_functions_patched_by_the_script():
    import math
    from unittest import mock
    first = ys([MEASURED], xs=[4, 9])
    own = math.sqrt, np.mean, json.dumps
    math.sqrt, np.mean, json.dumps = (lambda v: -1.0), (lambda a: 42.0), (lambda o: "PATCHED")
    try:
        patched = ys([MEASURED], xs=[4, 9])
    finally:
        math.sqrt, np.mean, json.dumps = own
    with mock.patch("math.sqrt", return_value=0.5):
        mocked = ys([MEASURED], xs=[4, 9])
    return [first, patched, mocked, ys([MEASURED], xs=[4, 9])]


class Scaled:
    def __init__(self, k):
        self.k = k

    def __call__(self, v):
        return v * self.k

    def negated(self, v):
        return -v * self.k


class Plain:  # an object that is no callable, whose bound method is
    def __init__(self, k):
        self.k = k

    def halved(self, v):
        return v / 2 + self.k


@pattern
def library_functions_patched_with_other_callables():
    import math
    own = math.sqrt, json.dumps
    factor = [2]
    patches = [("a partial", lambda: (math.sqrt, functools.partial(json.dumps, sort_keys=True))),
               ("an object", lambda: (Scaled(10), json.dumps)),
               ("a bound method", lambda: (Scaled(3).negated, json.dumps)),
               ("a bound method of an object that is no callable", lambda: (Plain(7).halved, json.dumps)),
               ("another library's function", lambda: (math.exp, json.dumps)),
               ("a lambda over a list changed between maps", lambda: ((lambda v: v * factor[0]), json.dumps))]
    out = []
    try:
        for name, patch in patches:
            math.sqrt, json.dumps = patch()
            out.append([name, ys([MEASURED], xs=[4, 9])])
        factor[0] = 5
        out.append(["the list changed", ys([MEASURED], xs=[4, 9])])
    finally:
        math.sqrt, json.dumps = own
    return out


@pattern
def state_of_a_zipped_and_a_bytecode_only_module():
    import os
    import py_compile
    import zipfile
    source = "from hardy import node\nSCALE = 1\nCONFIG = {'offset': 0}\n\n\n@node(output_name='y')\n" \
             "def f(x):\n    return x * SCALE + CONFIG['offset']\n"
    with zipfile.ZipFile("zipped_lib.zip", "w") as archive:
        archive.writestr("zipped_steps.py", source)
    os.makedirs("bytecode", exist_ok=True)
    py_compile.compile(write("pyc_source/pyc_steps.py", source), cfile="bytecode/pyc_steps.pyc")
    sys.path[:0] = [os.path.abspath("zipped_lib.zip"), os.path.abspath("bytecode")]
    import pyc_steps
    import zipped_steps
    out = []
    for module in (zipped_steps, pyc_steps):
        module.SCALE = 10
        module.CONFIG["offset"] = 5
        out.append(ys([module.f]))
    return out


@pattern
def a_module_served_by_a_custom_importer():
    import importlib.abc
    import importlib.util

    class DictImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "served_steps" else None

        def exec_module(self, module):
            exec("from hardy import node\nK = 11\n\n\n@node(output_name='y')\ndef f(x):\n    return x * K\n",
                 vars(module))

    importer = DictImporter()
    sys.meta_path.insert(0, importer)
    try:
        import served_steps
        served_steps.K = 12
        return ys([served_steps.f])
    finally:
        sys.meta_path.remove(importer)


@pattern
def a_module_name_pointed_at_another_module():
    write("renamed_settings.py", 'MODE = "default"\n')
    write("renamed_settings_prod.py", 'MODE = "prod"\n')
    write("renamed_steps.py", """
        from hardy import node

        @node(output_name="y")
        def label(x):
            import renamed_settings
            return f"{x}:{renamed_settings.MODE}"
    """)
    import renamed_settings_prod
    import renamed_steps
    sys.modules["renamed_settings"] = renamed_settings_prod
    try:
        return ys([renamed_steps.label])
    finally:
        del sys.modules["renamed_settings"]


@pattern
def a_c_function_wrapped_keeping_the_original():
    import math
    own_sqrt, own_round = math.sqrt, builtins.round

    def logged_sqrt(v):
        return own_sqrt(v) + 1000

    def round_half_up(v, n=0):
        return own_round(v + 1e-9, n)

    @node(output_name="y")
    def rooted(x):
        return math.sqrt(x) + round(x + 0.5)

    math.sqrt, builtins.round = logged_sqrt, round_half_up
    try:
        return ys([rooted], xs=[4.0, 9.0])
    finally:
        math.sqrt, builtins.round = own_sqrt, own_round


corpus.close()
