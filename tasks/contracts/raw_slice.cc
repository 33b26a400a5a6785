// ShardflowDecodeRawAt: bytes [offset, offset + length) of each serialized record, as uint8.
// ShardflowReadRecordsAt: the records framed at given offsets of shard files, CRCs checked.
//
// The same result as decode_raw(records, uint8, fixed_length=offset + length)[:, offset:]
// (a record shorter than offset + length reads as zeros past its end), in one copy: the
// stock ops copy each record once into a tensor and once more to drop the bytes before
// `offset`. Built and loaded by raw_slice.py, its module.
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "absl/crc/crc32c.h"

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

// ShardflowReadRecordsAt: record i is the TFRecord framed at byte offsets[i] of
// paths[file_ids[i]], sizes[i] bytes with its header and footer: one positional read
// (preadv) puts the header and footer aside and the data straight into the output string.
// The header's length must equal the size the index gives, and both masked CRC32Cs must
// match, or the op fails naming the file and the offset: a stale index or a damaged shard
// never passes as data. Files are opened on first use and kept open by the kernel.
REGISTER_OP("ShardflowReadRecordsAt")
    .Input("file_ids: int32")
    .Input("offsets: int64")
    .Input("sizes: int64")
    .Attr("paths: list(string)")
    .Output("records: string")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      c->set_output(0, ids);
      return ::tensorflow::OkStatus();
    });

namespace {

constexpr int64_t kHeaderBytes = 12;  // uint64 length, masked CRC32C of the length
constexpr int64_t kFooterBytes = 4;   // masked CRC32C of the data

uint32_t MaskedCrc(const char* data, size_t size) {
  const uint32_t crc = static_cast<uint32_t>(absl::ComputeCrc32c(absl::string_view(data, size)));
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

uint32_t LoadU32(const char* data) {
  uint32_t value;
  std::memcpy(&value, data, sizeof(value));
  return value;  // little-endian, as TFRecord writes it (and as x86 and ARM Linux hold it)
}

// Reads iov's bytes from `offset`, continuing after short reads; false at end of file.
bool ReadFully(int fd, iovec* iov, int count, off_t offset, int* error) {
  while (count > 0) {
    const ssize_t got = preadv(fd, iov, count, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      *error = got < 0 ? errno : 0;
      return false;
    }
    offset += got;
    size_t left = static_cast<size_t>(got);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

}  // namespace

class ReadRecordsAtOp : public OpKernel {
 public:
  explicit ReadRecordsAtOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("paths", &paths_));
    fds_.assign(paths_.size(), -1);
  }

  ~ReadRecordsAtOp() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const Tensor& offsets = ctx->input(1);
    const Tensor& sizes = ctx->input(2);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(ids.shape()) && offsets.shape() == ids.shape() &&
                    sizes.shape() == ids.shape(),
                ::tensorflow::errors::InvalidArgument(
                    "ShardflowReadRecordsAt: file_ids, offsets and sizes must be vectors of one "
                    "length, got ",
                    ids.shape().DebugString(), ", ", offsets.shape().DebugString(), ", ",
                    sizes.shape().DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    const auto id = ids.flat<int32_t>();
    const auto offset = offsets.flat<int64_t>();
    const auto size = sizes.flat<int64_t>();
    auto records = out->flat<tstring>();
    for (int64_t i = 0; i < id.size(); ++i) {
      OP_REQUIRES(ctx, id(i) >= 0 && id(i) < static_cast<int64_t>(paths_.size()),
                  ::tensorflow::errors::InvalidArgument("ShardflowReadRecordsAt: file id ", id(i),
                                                        " is not one of the ", paths_.size(),
                                                        " files"));
      const std::string& path = paths_[id(i)];
      const std::string where = path + " at byte " + std::to_string(offset(i));
      OP_REQUIRES(ctx, offset(i) >= 0 && size(i) >= kHeaderBytes + kFooterBytes,
                  ::tensorflow::errors::InvalidArgument("ShardflowReadRecordsAt: ", where,
                                                        ": no record fits in ", size(i),
                                                        " bytes (a stale offset index?)"));
      int fd = -1;
      OP_REQUIRES_OK(ctx, Open(id(i), &fd));
      const int64_t length = size(i) - kHeaderBytes - kFooterBytes;
      char header[kHeaderBytes];
      char footer[kFooterBytes];
      records(i).resize_uninitialized(length);
      iovec iov[3] = {{header, kHeaderBytes}, {records(i).data(), static_cast<size_t>(length)},
                      {footer, kFooterBytes}};
      int error = 0;
      OP_REQUIRES(ctx, ReadFully(fd, iov, 3, offset(i), &error),
                  ::tensorflow::errors::DataLoss(
                      "ShardflowReadRecordsAt: ", where, ": ",
                      error ? std::strerror(error) : "the file ends inside the record",
                      " (a truncated shard or a stale offset index)"));
      uint64_t stored = 0;
      std::memcpy(&stored, header, sizeof(stored));
      OP_REQUIRES(ctx, stored == static_cast<uint64_t>(length),
                  ::tensorflow::errors::DataLoss("ShardflowReadRecordsAt: ", where,
                                                 ": the record says ", stored,
                                                 " bytes, the offset index ", length,
                                                 " (a stale offset index?)"));
      OP_REQUIRES(ctx, MaskedCrc(header, 8) == LoadU32(header + 8),
                  ::tensorflow::errors::DataLoss("ShardflowReadRecordsAt: ", where,
                                                 ": the length's CRC does not match"));
      OP_REQUIRES(ctx, MaskedCrc(records(i).data(), length) == LoadU32(footer),
                  ::tensorflow::errors::DataLoss("ShardflowReadRecordsAt: ", where,
                                                 ": the data's CRC does not match (a damaged "
                                                 "shard)"));
    }
  }

 private:
  ::tensorflow::Status Open(int32_t id, int* fd) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (fds_[id] < 0) {
      const int opened = open(paths_[id].c_str(), O_RDONLY | O_CLOEXEC);
      if (opened < 0) {
        return ::tensorflow::errors::NotFound("ShardflowReadRecordsAt: cannot open ", paths_[id],
                                              ": ", std::strerror(errno));
      }
      fds_[id] = opened;
    }
    *fd = fds_[id];
    return ::tensorflow::OkStatus();
  }

  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::mutex mutex_;
};

REGISTER_KERNEL_BUILDER(Name("ShardflowReadRecordsAt").Device(::tensorflow::DEVICE_CPU),
                        ReadRecordsAtOp);

}  // namespace shardflow
