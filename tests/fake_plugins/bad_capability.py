from rollgen import Backend, GenerationConfig, hookimpl


@hookimpl
def rollgen_register_backends(register):
    register(Backend("weird", "x:Y", GenerationConfig, frozenset({"teleport"})))
