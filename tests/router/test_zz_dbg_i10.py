from tests.router.test_front_input import router  # noqa

def test_x(router):
    print("URL", router.http)
