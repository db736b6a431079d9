"""Horovod's reduction ops, as one enum every engine maps onto its library's."""
import enum


class ReduceOp(enum.Enum):
    """How values from every rank combine (Horovod's ops)."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
