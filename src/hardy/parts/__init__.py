"""A plan cut into parts run one after another: stages by what their nodes need (GPU or CPU workers,
Daft resources) and batched nodes run a group of items at a time. Above the plan, shipping and
observing (a part is shipped and its node events logged), below the executors that run them."""
