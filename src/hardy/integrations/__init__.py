"""Running maps on existing distributed engines (optional extras, imported lazily).

    from hardy.integrations.dask import DaskExecutor     # pip install "hardy[dask]"
    from hardy.integrations.ray import RayExecutor       # pip install "hardy[ray]"
    from hardy.integrations.daft import daft_engine       # pip install "hardy[daft]"
"""
