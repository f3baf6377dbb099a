"""The kernel verified by the lce harness's property engine, under the ``ci`` profile."""


def test_my_kernel(lce_verify):
    report = lce_verify("lce_adapter:adapter")
    assert report.passed
