"""Running maps on existing distributed engines (optional extras, imported lazily).

    from hardy.integrations.dask import DaskExecutor     # pip install "hardy[dask]"
    from hardy.integrations.ray import RayExecutor       # pip install "hardy[ray]"
"""
