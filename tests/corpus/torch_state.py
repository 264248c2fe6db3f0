# torch state a node reads: tensors rebound or changed in place, a small model trained by the
# script before the map, its mode switched, weights loaded from a file. (torch is imported here, in
# the script's own process: never in the test process.) Run as `python - EXECUTOR < torch_state.py`.
import torch

import corpus
from corpus import pattern, write
from hardy import Pipeline, node

engine = corpus.engine()
XS = [1, 2, 3]

write("torch_steps.py", """
    import torch
    from hardy import node

    torch.manual_seed(0)
    SCALE = torch.ones(3)
    BIAS = torch.zeros(1)
    TABLE = torch.zeros(10)
    MODEL = torch.nn.Linear(3, 1)
    NET = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    NORM = torch.nn.BatchNorm1d(3)
    PARTS = {"head": torch.nn.Linear(3, 2)}
    NOISE = torch.zeros(1)

    def features(x):
        return torch.tensor([[float(x), 2.0 * x, -x]])

    @node(output_name="y")
    def scaled(x):
        return float((SCALE * x).sum() + BIAS[0])

    @node(output_name="y")
    def looked_up(x):
        return [float(TABLE[x]), float(TABLE.sum()), TABLE.numel()]

    @node(output_name="y")
    def predicted(x):
        with torch.no_grad():
            return MODEL(features(x)).item()

    @node(output_name="y")
    def net_predicted(x):
        with torch.no_grad():
            return round(NET(features(x)).item(), 5)

    @node(output_name="y")
    def normalised(x):
        with torch.no_grad():
            return [round(v, 5) for v in NORM(features(x)).flatten().tolist()]

    @node(output_name="y")
    def head(x):
        with torch.no_grad():
            return [round(v, 5) for v in PARTS["head"](features(x)).flatten().tolist()]

    @node(output_name="y")
    def noise_total(x):
        return float(NOISE.sum()) + x

    @node(output_name="y")
    def under_modes(x):
        out = MODEL(features(x))
        return [round(out.item(), 5), out.requires_grad, torch.is_inference_mode_enabled(), torch.is_grad_enabled()]

    @node(output_name="y")
    def seeded_flags(x):
        import torch.backends.cudnn as cudnn  # (a module torch replaced with an object of its own class)
        return [cudnn.deterministic, cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision(), x]

    @node(output_name="y")
    def default_dtype(x):
        return [str((torch.tensor([0.1]) * x).dtype), (torch.tensor([0.1]) * x).item()]

    @node(output_name="y")
    def cast_predicted(x):
        with torch.no_grad():
            out = MODEL(features(x))
        return [str(out.dtype), out.item(), torch.is_autocast_enabled("cpu")]
""")
import torch_steps  # noqa: E402 -- written by the script above, as a user's module


def ys(nodes, xs=XS):
    out = corpus.pipeline(nodes, engine).map(inputs={"x": xs}, map_over="x")
    return [o["y"] for o in out]


@pattern
def tensor_rebound():
    torch_steps.SCALE = torch.tensor([1.0, 10.0, 100.0])
    return ys([torch_steps.scaled])


@pattern
def tensor_changed_in_place():
    first = ys([torch_steps.scaled])
    torch_steps.BIAS.add_(0.5)
    torch_steps.SCALE[0] = -1.0
    return [first, ys([torch_steps.scaled])]


@pattern
def big_tensor_rebound():
    torch_steps.TABLE = torch.arange(50_000, dtype=torch.float64)  # 400 KB, sums exact in any order
    return ys([torch_steps.looked_up])


@pattern
def big_tensor_changed_in_place():
    torch_steps.TABLE = torch.ones(40_000)
    first = ys([torch_steps.looked_up])
    torch_steps.TABLE[:100] *= 3
    return [first, ys([torch_steps.looked_up])]


@pattern
def model_trained_in_place_before_the_map():
    model = torch_steps.MODEL
    torch.manual_seed(1)
    inputs, targets = torch.randn(32, 3), torch.randn(32, 1)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    before = ys([torch_steps.predicted])
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return [before, ys([torch_steps.predicted])]


@pattern
def model_weights_loaded_from_a_file():
    torch.manual_seed(7)
    torch.save(torch.nn.Linear(3, 1).state_dict(), "weights.pt")
    torch_steps.MODEL.load_state_dict(torch.load("weights.pt"))
    return ys([torch_steps.predicted])


@pattern
def model_switched_to_eval_mode():
    # in training mode Dropout draws at random; the script switches to eval before the map
    torch_steps.NET.eval()
    return ys([torch_steps.net_predicted])


@pattern
def batchnorm_running_statistics_updated_by_forward_passes():
    norm = torch_steps.NORM
    norm.train()
    torch.manual_seed(3)
    for _ in range(3):
        norm(torch.randn(16, 3) * 5 + 2)  # updates running_mean / running_var in place
    norm.eval()
    return ys([torch_steps.normalised])


@pattern
def model_in_a_dict_replaced():
    torch.manual_seed(11)
    torch_steps.PARTS["head"] = torch.nn.Linear(3, 2)
    return ys([torch_steps.head])


@pattern
def float32_sum_over_a_big_tensor():
    # a float32 reduction's rounding depends on how many threads torch splits it over
    torch_steps.NOISE = torch.rand(1_000_000, generator=torch.Generator().manual_seed(0))
    return ys([torch_steps.noise_total])


@pattern
def default_dtype_set_by_the_script():
    torch.set_default_dtype(torch.float64)
    try:
        return ys([torch_steps.default_dtype])
    finally:
        torch.set_default_dtype(torch.float32)


@pattern
def map_in_inference_mode_then_without():
    # `with torch.inference_mode():` around an evaluation loop; then a map outside it builds graphs
    torch.manual_seed(3)
    torch_steps.MODEL = torch.nn.Linear(3, 1)
    with torch.inference_mode():
        inside = ys([torch_steps.under_modes])
    return [inside, ys([torch_steps.under_modes])]


@pattern
def map_under_autocast_then_another_dtype_then_without():
    # mixed-precision inference: `torch.autocast` around the map, as `torch.no_grad()` would be
    torch.manual_seed(4)
    torch_steps.MODEL = torch.nn.Linear(3, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bfloat16 = ys([torch_steps.cast_predicted])
    with torch.autocast("cpu", dtype=torch.float16):
        float16 = ys([torch_steps.cast_predicted])
    return [bfloat16, float16, ys([torch_steps.cast_predicted])]


@pattern
def autocast_entered_again_after_a_training_step():
    # AMP's recipe: autocast around each forward pass, the optimiser's step outside it (a worker
    # holding autocast for its caller must not cast the weights from before the step)
    torch.manual_seed(5)
    torch_steps.MODEL = torch.nn.Linear(3, 1)
    optimiser = torch.optim.SGD(torch_steps.MODEL.parameters(), lr=0.5)
    answers = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            answers.append(ys([torch_steps.cast_predicted]))
            loss = torch_steps.MODEL(torch.ones(4, 3)).float().pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return answers


@pattern
def seed_helper_sets_cudnn_flags_and_matmul_precision():
    # the `set_seed` helper of many training scripts
    def set_seed(seed):
        torch.manual_seed(seed)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("high")

    before = ys([torch_steps.seeded_flags])
    set_seed(0)
    try:
        return [before, ys([torch_steps.seeded_flags])]
    finally:
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")


@pattern
def parameters_updated_through_data_between_maps():
    # an older training loop's manual step: `p.data -= lr * grad` (torch counts no version for it)
    torch.manual_seed(5)
    torch_steps.MODEL = torch.nn.Linear(3, 1)
    first = ys([torch_steps.predicted])
    for p in torch_steps.MODEL.parameters():
        p.data -= 0.5 * torch.ones_like(p)
    return [first, ys([torch_steps.predicted])]


@pattern
def tensor_written_through_a_numpy_view_between_maps():
    torch_steps.SCALE = torch.ones(3)
    torch_steps.BIAS = torch.zeros(1)
    first = ys([torch_steps.scaled])
    torch_steps.SCALE.numpy()[:] = 4.0
    return [first, ys([torch_steps.scaled])]


@pattern
def grad_disabled_by_the_script():
    @node(output_name="y")
    def scaled(x):
        w = torch.ones(2, requires_grad=True)
        return [(w * x).requires_grad, torch.is_grad_enabled()]

    with torch.no_grad():
        return [o["y"] for o in Pipeline(nodes=[scaled], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")]


@pattern
def deterministic_algorithms_that_only_warn():
    @node(output_name="y")
    def accumulated(x):
        t = torch.zeros(3)
        try:  # one index twice: not deterministic, refused, or done with a warning when warn_only
            t.put_(torch.tensor([0, 0]), torch.tensor([1.0, 1.0 * x]))
            done = "ran"
        except RuntimeError:
            done = "refused"
        return [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                done]

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return [o["y"] for o in Pipeline(nodes=[accumulated], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")]
    finally:
        torch.use_deterministic_algorithms(False)


def _doubled_output(module, inputs, output):
    return output * 2


@pattern
def forward_hook_registered_between_maps():
    write("hook_steps.py", """
        import torch

        from hardy import node

        torch.manual_seed(0)
        MODEL = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(MODEL.weight, 1.0)
        torch.nn.init.constant_(MODEL.bias, 0.0)

        @node(output_name="y")
        def predicted(x):
            with torch.no_grad():
                return float(MODEL(torch.tensor([float(x), 1.0]))[0])
    """)
    import hook_steps
    first = ys([hook_steps.predicted])
    hook_steps.MODEL.register_forward_hook(_doubled_output)
    return [first, ys([hook_steps.predicted])]


@pattern
def submodule_frozen_with_requires_grad_between_maps():
    # fine-tuning only the head: `NET[0].requires_grad_(False)` bumps no version counter
    write("freeze_steps.py", """
        import copy

        import torch

        from hardy import node

        torch.manual_seed(0)
        NET = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

        @node(output_name="y")
        def adapted(x):  # one step of test-time adaptation on the trainable parameters
            m = copy.deepcopy(NET)
            opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
            (m(torch.ones(1, 3)) - x).pow(2).sum().backward()
            opt.step()
            with torch.no_grad():
                return [round(m(torch.ones(1, 3)).item(), 4), [p.requires_grad for p in NET.parameters()]]
    """)
    import freeze_steps
    first = ys([freeze_steps.adapted], [1, 5])
    freeze_steps.NET[0].requires_grad_(False)
    return [first, ys([freeze_steps.adapted], [1, 5])]


@pattern
def gradients_filled_by_backward_between_maps():
    # a gradient-based importance read from `.grad` after the script's `loss.backward()`
    write("grad_steps.py", """
        import torch

        from hardy import node

        torch.manual_seed(0)
        MODEL = torch.nn.Linear(3, 1)

        @node(output_name="y")
        def importance(x):
            g = MODEL.weight.grad
            return None if g is None else [round(v * x, 4) for v in g.abs().flatten().tolist()]
    """)
    import grad_steps
    first = ys([grad_steps.importance])
    grad_steps.MODEL(torch.tensor([[1.0, 2.0, 3.0]])).sum().backward()
    second = ys([grad_steps.importance])
    grad_steps.MODEL(torch.tensor([[1.0, 1.0, 1.0]])).sum().backward()  # accumulated: the same grad, written
    return [first, second, ys([grad_steps.importance])]


@pattern
def attribute_set_on_a_tensor_between_maps():
    write("tagged_steps.py", """
        import torch

        from hardy import node

        SCALE = torch.ones(3)

        @node(output_name="y")
        def tagged(x):
            return [getattr(SCALE, "unit", None), x]
    """)
    import tagged_steps
    first = ys([tagged_steps.tagged])
    tagged_steps.SCALE.unit = "kg"
    return [first, ys([tagged_steps.tagged]), ys([tagged_steps.tagged], [4])]


corpus.close()
