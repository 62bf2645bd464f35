from rollgen import Backend, GenerationConfig, hookimpl


@hookimpl
def rollgen_register_backends(register):
    register(Backend("good", "x:Y", GenerationConfig, frozenset()))
