"""Builds kvstore's optional compiled core (``kvstore/net/_wire_core.c``); everything else is
declared in pyproject.toml. Where no C compiler or Python headers exist the build skips it
(``optional=True``) and kvstore reads replies with its Python path (``kvstore/net/wire.py``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.net._wire_core",
            ["kvstore/net/_wire_core.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
