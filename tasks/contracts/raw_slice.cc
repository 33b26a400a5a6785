// ShardflowDecodeRawAt: bytes [offset, offset + length) of each serialized record, as uint8.
//
// The same result as decode_raw(records, uint8, fixed_length=offset + length)[:, offset:]
// (a record shorter than offset + length reads as zeros past its end), in one copy: the
// stock ops copy each record once into a tensor and once more to drop the bytes before
// `offset`. Built and loaded by raw_slice.py, its module.
#include <algorithm>
#include <cstring>
#include <limits>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace shardflow {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::tstring;
using ::tensorflow::uint8;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("ShardflowDecodeRawAt")
    .Input("records: string")
    .Attr("offset: int >= 0")
    .Attr("length: int >= 1")
    .Output("bytes: uint8")
    .SetShapeFn([](InferenceContext* c) {
      int64_t length;
      TF_RETURN_IF_ERROR(c->GetAttr("length", &length));
      ShapeHandle records;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &records));
      c->set_output(0, c->Matrix(c->Dim(records, 0), length));
      return ::tensorflow::OkStatus();
    });

class DecodeRawAtOp : public OpKernel {
 public:
  explicit DecodeRawAtOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("offset", &offset_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("length", &length_));
    // offset + length must fit in int64: a range past it is an error, never a wrapped read
    OP_REQUIRES(ctx, offset_ <= std::numeric_limits<int64_t>::max() - length_,
                ::tensorflow::errors::InvalidArgument("ShardflowDecodeRawAt: offset ", offset_,
                                                      " + length ", length_,
                                                      " overflows int64"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& records = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(records.shape()),
                ::tensorflow::errors::InvalidArgument(
                    "ShardflowDecodeRawAt: records must be a vector, got shape ",
                    records.shape().DebugString()));
    const auto flat = records.flat<tstring>();
    const int64_t count = flat.size();
    // records x length elements must fit a tensor: an error, never TensorShape's CHECK abort
    TensorShape shape;
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape({count, length_}, &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    uint8* row = out->flat<uint8>().data();
    for (int64_t i = 0; i < count; ++i, row += length_) {
      const int64_t size = static_cast<int64_t>(flat(i).size());
      const int64_t copied = std::clamp<int64_t>(size - offset_, 0, length_);
      if (copied > 0) std::memcpy(row, flat(i).data() + offset_, copied);
      if (copied < length_) std::memset(row + copied, 0, length_ - copied);
    }
  }

 private:
  int64_t offset_;
  int64_t length_;
};

REGISTER_KERNEL_BUILDER(Name("ShardflowDecodeRawAt").Device(::tensorflow::DEVICE_CPU),
                        DecodeRawAtOp);

}  // namespace shardflow
