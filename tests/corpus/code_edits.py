# Code edited while the script runs: a module's file rewritten, then `importlib.reload`ed or not,
# between two calls on one engine (its workers warm, or replaced after a crash). The calling process
# runs the code it has loaded; so must every worker. Run as `python - EXECUTOR < code_edits.py`.
import importlib

import corpus
from corpus import pattern, write
from hardy import DiskCache, NodeCrashed, Pipeline, node

engine = corpus.engine()
XS = [1, 2, 3]

STEPS = """
    from hardy import node
    OFFSET = {offset}

    @node(output_name="y")
    def transform(x):
        return x * {factor} + OFFSET
"""


def ys(nodes, xs=XS, output="y", **options):
    out = corpus.pipeline(nodes, engine, **options).map(inputs={"x": xs}, map_over="x")
    return [o[output] for o in out]


@pattern
def node_module_edited_and_reloaded():
    write("nm_steps.py", STEPS.format(offset=0, factor=10))
    import nm_steps
    first = ys([nm_steps.transform])
    write("nm_steps.py", STEPS.format(offset=1, factor=100))
    importlib.reload(nm_steps)
    return [first, ys([nm_steps.transform]), nm_steps.transform(1)]


@pattern
def pipeline_built_before_the_reload_and_called_after():
    write("old_steps.py", STEPS.format(offset=0, factor=10))
    import old_steps
    p = Pipeline(nodes=[old_steps.transform], engine=engine)
    first = p.map(inputs={"x": XS}, map_over="x")
    write("old_steps.py", STEPS.format(offset=1, factor=100))
    importlib.reload(old_steps)
    return [first, p.map(inputs={"x": XS}, map_over="x"), p.run(inputs={"x": 1})]


@pattern
def helper_module_edited_and_reloaded():
    write("hr_helpers.py", "def helper(x):\n    return x + 10\n")
    write("hr_steps.py", """
        import hr_helpers
        from hardy import node

        @node(output_name="y")
        def helped(x):
            return hr_helpers.helper(x)
    """)
    import hr_helpers
    import hr_steps
    first = ys([hr_steps.helped])
    write("hr_helpers.py", "def helper(x):\n    return x + 1000\n")
    importlib.reload(hr_helpers)
    return [first, ys([hr_steps.helped])]


@pattern
def helper_imported_by_name_then_its_module_reloaded():
    write("fi_helpers.py", "def scale(x):\n    return x * 2\n")
    write("fi_steps.py", """
        from fi_helpers import scale
        from hardy import node

        @node(output_name="y")
        def scaled(x):
            return scale(x)
    """)
    import fi_helpers
    import fi_steps
    first = ys([fi_steps.scaled])
    write("fi_helpers.py", "def scale(x):\n    return x * 3\n")
    importlib.reload(fi_helpers)  # fi_steps still holds the old `scale`: so does the calling process
    return [first, ys([fi_steps.scaled]), fi_steps.scaled(1)]


@pattern
def node_module_edited_without_reload():
    write("nr_steps.py", STEPS.format(offset=0, factor=10))
    import nr_steps
    first = ys([nr_steps.transform])
    write("nr_steps.py", STEPS.format(offset=1, factor=100))
    return [first, ys([nr_steps.transform]), nr_steps.transform(1)]


@pattern
def node_module_edited_before_the_first_call():
    write("nf_steps.py", STEPS.format(offset=5, factor=10))
    import nf_steps
    write("nf_steps.py", STEPS.format(offset=6, factor=100))  # no worker has imported it yet
    return [ys([nf_steps.transform]), nf_steps.transform(1)]


@pattern
def helper_module_edited_without_reload():
    write("hn_helpers.py", "LIMIT = 2\n\ndef clip(x):\n    return min(x, LIMIT)\n")
    write("hn_steps.py", """
        import hn_helpers
        from hardy import node

        @node(output_name="y")
        def clipped(x):
            return hn_helpers.clip(x)
    """)
    import hn_steps
    write("hn_helpers.py", "LIMIT = 100\n\ndef clip(x):\n    return -x\n")
    return [ys([hn_steps.clipped]), hn_steps.clipped(3)]


@pattern
def edited_without_reload_then_reloaded():
    write("er_steps.py", STEPS.format(offset=0, factor=10))
    import er_steps
    write("er_steps.py", STEPS.format(offset=1, factor=100))
    stale = ys([er_steps.transform])
    importlib.reload(er_steps)
    return [stale, ys([er_steps.transform])]


@pattern
def edited_reloaded_and_edited_back():
    write("aba_steps.py", STEPS.format(offset=0, factor=10))
    import aba_steps
    first = ys([aba_steps.transform])
    write("aba_steps.py", STEPS.format(offset=0, factor=20))
    importlib.reload(aba_steps)
    second = ys([aba_steps.transform])
    write("aba_steps.py", STEPS.format(offset=0, factor=10))
    importlib.reload(aba_steps)
    return [first, second, ys([aba_steps.transform])]


CLASS = """
    class Scaler:
        def __init__(self, factor):
            self.factor = factor

        def apply(self, x):
            return x * self.factor{extra}
"""


@pattern
def class_edited_and_reloaded():
    write("cl_shapes.py", CLASS.format(extra=""))
    write("cl_steps.py", """
        import cl_shapes
        from hardy import node

        @node(output_name="y")
        def scaled(x):
            return cl_shapes.Scaler(3).apply(x)
    """)
    import cl_shapes
    import cl_steps
    first = ys([cl_steps.scaled])
    write("cl_shapes.py", CLASS.format(extra=" + 1000"))
    importlib.reload(cl_shapes)
    return [first, ys([cl_steps.scaled])]


@pattern
def class_imported_by_name_then_its_module_reloaded():
    write("cn_shapes.py", CLASS.format(extra=""))
    write("cn_steps.py", """
        from cn_shapes import Scaler
        from hardy import node

        @node(output_name="y")
        def scaled(x):
            return Scaler(3).apply(x)
    """)
    import cn_shapes
    import cn_steps
    write("cn_shapes.py", CLASS.format(extra=" + 1000"))
    importlib.reload(cn_shapes)  # cn_steps.Scaler is still the old class here
    return ys([cn_steps.scaled])


@pattern
def instance_of_an_edited_class_given_as_input():
    write("in_shapes.py", CLASS.format(extra=""))
    import in_shapes
    write("in_shapes.py", CLASS.format(extra=" + 1000"))  # not reloaded: this process has the old class

    @node(output_name="y")
    def applied(scaler, x):
        return scaler.apply(x)

    out = Pipeline(nodes=[applied], engine=engine).map(inputs={"x": XS, "scaler": in_shapes.Scaler(5)}, map_over="x")
    return [o["y"] for o in out]


@pattern
def output_name_changed_and_reloaded():
    write("on_steps.py", STEPS.format(offset=0, factor=1))
    import on_steps
    first = Pipeline(nodes=[on_steps.transform], engine=engine).map(inputs={"x": XS}, map_over="x")
    write("on_steps.py", STEPS.format(offset=0, factor=2).replace('output_name="y"', 'output_name="z"'))
    importlib.reload(on_steps)
    return [first, Pipeline(nodes=[on_steps.transform], engine=engine).map(inputs={"x": XS}, map_over="x")]


@pattern
def new_node_added_and_reloaded():
    write("nn_steps.py", STEPS.format(offset=0, factor=1))
    import nn_steps
    first = ys([nn_steps.transform])
    write("nn_steps.py", STEPS.format(offset=0, factor=1) + """
    @node(output_name="z")
    def squared(y):
        return y * y + OFFSET
""")
    importlib.reload(nn_steps)
    nn_steps.OFFSET = 7
    return [first, ys([nn_steps.transform, nn_steps.squared], output="z")]


@pattern
def constant_edited_and_reloaded_read_by_a_script_node():
    write("ce_consts.py", "THRESHOLD = 2\n")
    import ce_consts

    @node(output_name="y")
    def above(x):
        return x > ce_consts.THRESHOLD

    first = ys([above])
    write("ce_consts.py", "THRESHOLD = 0\n")
    importlib.reload(ce_consts)
    return [first, ys([above])]


@pattern
def decorated_helper_edited_and_reloaded():
    write("dh_helpers.py", """
        import functools

        def logged(fn):
            @functools.wraps(fn)
            def wrapper(*a):
                return ("logged", fn(*a))
            return wrapper

        @logged
        def helper(x):
            return x + {add}
    """.replace("{add}", "1"))
    write("dh_steps.py", """
        import dh_helpers
        from hardy import node

        @node(output_name="y")
        def helped(x):
            return dh_helpers.helper(x)
    """)
    import dh_helpers
    import dh_steps
    first = ys([dh_steps.helped])
    with open("dh_helpers.py") as f:
        source = f.read()
    write("dh_helpers.py", source.replace("x + 1", "x + 500"))
    importlib.reload(dh_helpers)
    return [first, ys([dh_steps.helped])]


@pattern
def module_imported_inside_the_node_edited_without_reload():
    write("late_mod.py", "def value(x):\n    return x + 1\n")
    import late_mod  # noqa: F401 -- the script has it loaded, as after an earlier cell
    write("li_steps.py", """
        from hardy import node

        @node(output_name="y")
        def lately(x):
            import late_mod
            return late_mod.value(x)
    """)
    import li_steps
    write("late_mod.py", "def value(x):\n    return x - 1000\n")
    return ys([li_steps.lately])


@pattern
def module_file_broken_after_import():
    write("br_steps.py", STEPS.format(offset=3, factor=10))
    import br_steps
    write("br_steps.py", "def transform(x)\n    return x  # a syntax error, mid-edit\n")
    return [ys([br_steps.transform]), br_steps.transform(1)]


@pattern
def module_file_deleted_after_import():
    import os
    write("gone_steps.py", STEPS.format(offset=4, factor=10))
    import gone_steps
    os.remove("gone_steps.py")
    importlib.invalidate_caches()
    return ys([gone_steps.transform])


@pattern
def reload_with_a_cache_attached():
    write("rc_steps.py", """
        from hardy import node

        @node(output_name="y")
        def logged(x, log):
            with open(log, "a") as f:
                f.write(f"{x}\\n")
            return x * 10
    """)
    import rc_steps
    cache = DiskCache(".cache-reload")

    def call():
        out = Pipeline(nodes=[rc_steps.logged], engine=engine, cache=cache).map(
            inputs={"x": XS, "log": "rc.log"}, map_over="x")
        return [o["y"] for o in out]

    first, again = call(), call()
    with open("rc_steps.py") as f:
        source = f.read()
    write("rc_steps.py", source.replace("x * 10", "x * 20"))
    importlib.reload(rc_steps)
    second, third = call(), call()
    with open("rc.log") as f:
        computed = len(f.read().split())
    return [first, again, second, third, computed]


@pattern
def edited_without_reload_with_a_cache_attached():
    write("ec_steps.py", STEPS.format(offset=0, factor=3))
    import ec_steps
    write("ec_steps.py", STEPS.format(offset=0, factor=4))
    return ys([ec_steps.transform], cache=DiskCache(".cache-edit"))


CRASHY = """
    import ctypes
    from hardy import node
    OFFSET = {offset}

    @node(output_name="y")
    def transform(x):
        if x == 4:
            ctypes.string_at(0)  # a native bug on one item
        return x * 10 + OFFSET
"""


@pattern
def worker_crash_mid_map_after_an_edit_without_reload():
    write("wc_steps.py", CRASHY.format(offset=1))
    import wc_steps
    warm = ys([wc_steps.transform])  # the workers import the file as it is now
    write("wc_steps.py", CRASHY.format(offset=2))  # edited; replacement workers will import this
    xs = list(range(1, 11))
    if corpus.IN_PROCESS:  # a segfault here would end this process: the innocent items only
        xs.remove(4)
    out = Pipeline(nodes=[wc_steps.transform], engine=engine).map(inputs={"x": xs}, map_over="x", on_error="continue")
    if not corpus.IN_PROCESS:
        crashed = out.pop(3)
        assert isinstance(crashed.error, NodeCrashed), crashed
    return [warm, out]


@pattern
def edit_then_reload_between_two_runs():
    write("rr_steps.py", STEPS.format(offset=0, factor=10))
    import rr_steps
    p = Pipeline(nodes=[rr_steps.transform], engine=engine)
    first = p.run(inputs={"x": 2})
    write("rr_steps.py", STEPS.format(offset=9, factor=10))
    importlib.reload(rr_steps)
    return [first, Pipeline(nodes=[rr_steps.transform], engine=engine).run(inputs={"x": 2})]


@pattern
def reload_between_imap_calls():
    write("im_steps.py", STEPS.format(offset=0, factor=10))
    import im_steps
    first = [o["y"] for o in Pipeline(nodes=[im_steps.transform], engine=engine).imap(inputs={"x": XS}, map_over="x")]
    write("im_steps.py", STEPS.format(offset=0, factor=-10))
    importlib.reload(im_steps)
    second = sorted(o["y"] for o in Pipeline(nodes=[im_steps.transform], engine=engine).imap(
        inputs={"x": XS}, map_over="x", ordered=False))
    return [first, second]


@pattern
def script_function_redefined_between_maps():
    def helper(x):
        return x + 1

    @node(output_name="y")
    def helped(x):
        return helper(x)

    p = Pipeline(nodes=[helped], engine=engine)
    first = p.map(inputs={"x": XS}, map_over="x")

    def helper(x):  # noqa: F811 -- the user's second version
        return x + 2

    return [first, p.map(inputs={"x": XS}, map_over="x")]


@pattern
def nested_pipeline_built_before_a_reload():
    write("nest_steps.py", STEPS.format(offset=0, factor=10))
    import nest_steps
    inner = Pipeline(nodes=[nest_steps.transform], name="inner")
    p = Pipeline(nodes=[inner.as_node(input_mapping={"xs": "x"}, output_mapping={"y": "ys"}, map_over="xs")],
                 engine=engine)
    first = p.run(inputs={"xs": XS})
    write("nest_steps.py", STEPS.format(offset=1, factor=100))
    importlib.reload(nest_steps)  # `inner` still holds the node it was built with
    return [first, p.run(inputs={"xs": XS}), p.map(inputs={"xs": [[1], [2, 3]]}, map_over="xs")]


corpus.close()
