from rollgen import Backend, Capability, GenerationConfig, hookimpl


@hookimpl
def rollgen_register_backends(register):
    register(
        Backend(
            "good",
            "rollgen_example.engine:ExampleGeneration",
            GenerationConfig,
            frozenset({Capability.LOGPROBS}),
        )
    )
    register(
        Backend(
            "good-missing-engine",
            "no_such_engine_pkg.x:Y",
            GenerationConfig,
            frozenset(),
            requires=("no_such_engine_pkg",),
            install_hint="pip install no-such-engine",
        )
    )
