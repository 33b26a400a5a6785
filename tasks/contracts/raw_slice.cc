// ShardflowDecodeRawAt: bytes [offset, offset + length) of each serialized record, as uint8.
// ShardflowReadRecordsAt: the records framed at given offsets of shard files, CRCs checked.
// ShardflowReadRawAt: those records' pixels and labels, read straight into the batch.
//
// ShardflowDecodeRawAt gives the same result as
// decode_raw(records, uint8, fixed_length=offset + length)[:, offset:] (a record shorter
// than offset + length reads as zeros past its end), in one copy: the stock ops copy each
// record once into a tensor and once more to drop the bytes before `offset`. Built and
// loaded by raw_slice.py, its module.
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
// (preadv) puts the header and footer aside and the data straight into the output string,
// checked as ShardFiles::ReadFramed says.
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

uint32_t Masked(absl::crc32c_t sum) {
  const uint32_t crc = static_cast<uint32_t>(sum);
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

constexpr int kMaxDataParts = 3;

// The shard files of one kernel, opened on first use and kept open; and the framed read
// both kernels make: the record at `offset` of file `id`, `size` bytes with its header and
// footer, its data scattered over `data` (at most kMaxDataParts buffers, their lengths
// summing to the data's), one preadv. The header's length must equal the size the index
// gives, and both masked CRC32Cs must match, or the read fails naming the file and the
// offset: a stale index or a damaged shard never passes as data.
class ShardFiles {
 public:
  ShardFiles(const char* op, std::vector<std::string> paths)
      : op_(op), paths_(std::move(paths)), fds_(paths_.size(), -1) {}

  ~ShardFiles() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }

  // The data bytes of the record at `offset` of `id` that `size` frames, or an error.
  ::tensorflow::Status CheckedSize(int32_t id, int64_t offset, int64_t size,
                                   int64_t* length) const {
    if (id < 0 || id >= static_cast<int64_t>(paths_.size())) {
      return ::tensorflow::errors::InvalidArgument(op_, ": file id ", id, " is not one of the ",
                                                   paths_.size(), " files");
    }
    if (offset < 0 || size < kHeaderBytes + kFooterBytes) {
      return ::tensorflow::errors::InvalidArgument(op_, ": ", Where(id, offset),
                                                   ": no record fits in ", size,
                                                   " bytes (a stale offset index?)");
    }
    *length = size - kHeaderBytes - kFooterBytes;
    return ::tensorflow::OkStatus();
  }

  ::tensorflow::Status ReadFramed(int32_t id, int64_t offset, int64_t length,
                                  const iovec* data, int parts) {
    int fd = -1;
    TF_RETURN_IF_ERROR(Open(id, &fd));
    char header[kHeaderBytes];
    char footer[kFooterBytes];
    iovec iov[kMaxDataParts + 2];
    iov[0] = {header, kHeaderBytes};
    std::copy(data, data + parts, iov + 1);
    iov[parts + 1] = {footer, kFooterBytes};
    int error = 0;
    if (!ReadFully(fd, iov, parts + 2, offset, &error)) {
      return ::tensorflow::errors::DataLoss(
          op_, ": ", Where(id, offset), ": ",
          error ? std::strerror(error) : "the file ends inside the record",
          " (a truncated shard or a stale offset index)");
    }
    uint64_t stored = 0;
    std::memcpy(&stored, header, sizeof(stored));
    if (stored != static_cast<uint64_t>(length)) {
      return ::tensorflow::errors::DataLoss(op_, ": ", Where(id, offset), ": the record says ",
                                            stored, " bytes, the offset index ", length,
                                            " (a stale offset index?)");
    }
    if (Masked(absl::ComputeCrc32c(absl::string_view(header, 8))) != LoadU32(header + 8)) {
      return ::tensorflow::errors::DataLoss(op_, ": ", Where(id, offset),
                                            ": the length's CRC does not match");
    }
    absl::crc32c_t sum(0);
    for (int part = 0; part < parts; ++part) {  // `data` as given: ReadFully moved iov's
      sum = absl::ExtendCrc32c(
          sum, absl::string_view(static_cast<const char*>(data[part].iov_base),
                                 data[part].iov_len));
    }
    if (Masked(sum) != LoadU32(footer)) {
      return ::tensorflow::errors::DataLoss(op_, ": ", Where(id, offset),
                                            ": the data's CRC does not match (a damaged "
                                            "shard)");
    }
    return ::tensorflow::OkStatus();
  }

 private:
  std::string Where(int32_t id, int64_t offset) const {
    return paths_[id] + " at byte " + std::to_string(offset);
  }

  ::tensorflow::Status Open(int32_t id, int* fd) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (fds_[id] < 0) {
      const int opened = open(paths_[id].c_str(), O_RDONLY | O_CLOEXEC);
      if (opened < 0) {
        return ::tensorflow::errors::NotFound(op_, ": cannot open ", paths_[id], ": ",
                                              std::strerror(errno));
      }
      fds_[id] = opened;
    }
    *fd = fds_[id];
    return ::tensorflow::OkStatus();
  }

  const char* op_;
  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::mutex mutex_;
};

std::vector<std::string> PathsAttr(OpKernelConstruction* ctx) {
  std::vector<std::string> paths;
  const ::tensorflow::Status read = ctx->GetAttr("paths", &paths);
  if (!read.ok()) ctx->CtxFailure(__FILE__, __LINE__, read);
  return paths;
}

::tensorflow::Status SameLengthVectors(const char* op, const Tensor& ids, const Tensor& offsets,
                                       const Tensor& sizes) {
  if (TensorShapeUtils::IsVector(ids.shape()) && offsets.shape() == ids.shape() &&
      sizes.shape() == ids.shape()) {
    return ::tensorflow::OkStatus();
  }
  return ::tensorflow::errors::InvalidArgument(
      op, ": file_ids, offsets and sizes must be vectors of one length, got ",
      ids.shape().DebugString(), ", ", offsets.shape().DebugString(), ", ",
      sizes.shape().DebugString());
}

bool MatchesMasked(const char* actual, const std::string& want, const std::string& mask) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (((actual[i] ^ want[i]) & mask[i]) != 0) return false;
  }
  return true;
}

}  // namespace

class ReadRecordsAtOp : public OpKernel {
 public:
  explicit ReadRecordsAtOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), files_("ShardflowReadRecordsAt", PathsAttr(ctx)) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const Tensor& offsets = ctx->input(1);
    const Tensor& sizes = ctx->input(2);
    OP_REQUIRES_OK(ctx, SameLengthVectors("ShardflowReadRecordsAt", ids, offsets, sizes));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    const auto id = ids.flat<int32_t>();
    const auto offset = offsets.flat<int64_t>();
    const auto size = sizes.flat<int64_t>();
    auto records = out->flat<tstring>();
    for (int64_t i = 0; i < id.size(); ++i) {
      int64_t length = 0;
      OP_REQUIRES_OK(ctx, files_.CheckedSize(id(i), offset(i), size(i), &length));
      records(i).resize_uninitialized(length);
      const iovec data = {records(i).data(), static_cast<size_t>(length)};
      OP_REQUIRES_OK(ctx, files_.ReadFramed(id(i), offset(i), length, &data, 1));
    }
  }

 private:
  ShardFiles files_;
};

REGISTER_KERNEL_BUILDER(Name("ShardflowReadRecordsAt").Device(::tensorflow::DEVICE_CPU),
                        ReadRecordsAtOp);

// ShardflowReadRawAt: ShardflowReadRecordsAt's records, framed, sized and CRC checked alike,
// each read with one preadv whose pixels land in row i of `images` (the batch itself) and
// whose label is the byte at `label_offset`: no record string, no second copy. Row i is
// trusted only where record i's bytes before the pixels equal `head` on the bits of
// `head_mask` and the bytes after them begin with `tail` on `tail_mask` (the layout proof
// of tasks.schema.raw_layout); `proven` is false if any record of the batch is not, and
// the caller then reads the batch by parsing it.
REGISTER_OP("ShardflowReadRawAt")
    .Input("file_ids: int32")
    .Input("offsets: int64")
    .Input("sizes: int64")
    .Attr("paths: list(string)")
    .Attr("image_bytes: int >= 1")
    .Attr("label_offset: int >= 0")
    .Attr("head: string")
    .Attr("head_mask: string")
    .Attr("tail: string")
    .Attr("tail_mask: string")
    .Output("images: uint8")
    .Output("labels: int32")
    .Output("proven: bool")
    .SetShapeFn([](InferenceContext* c) {
      int64_t image_bytes;
      TF_RETURN_IF_ERROR(c->GetAttr("image_bytes", &image_bytes));
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), image_bytes));
      c->set_output(1, ids);
      c->set_output(2, c->Scalar());
      return ::tensorflow::OkStatus();
    });

class ReadRawAtOp : public OpKernel {
 public:
  explicit ReadRawAtOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), files_("ShardflowReadRawAt", PathsAttr(ctx)) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("image_bytes", &image_bytes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label_offset", &label_offset_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("head", &head_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("head_mask", &head_mask_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tail", &tail_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tail_mask", &tail_mask_));
    const int64_t tail_offset = static_cast<int64_t>(head_.size()) + image_bytes_;
    OP_REQUIRES(ctx,
                head_mask_.size() == head_.size() && tail_mask_.size() == tail_.size() &&
                    label_offset_ >= tail_offset &&
                    label_offset_ < tail_offset + static_cast<int64_t>(tail_.size()),
                ::tensorflow::errors::InvalidArgument(
                    "ShardflowReadRawAt: each mask must be as long as its template and the "
                    "label must lie in the tail"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const Tensor& offsets = ctx->input(1);
    const Tensor& sizes = ctx->input(2);
    OP_REQUIRES_OK(ctx, SameLengthVectors("ShardflowReadRawAt", ids, offsets, sizes));
    const auto id = ids.flat<int32_t>();
    const auto offset = offsets.flat<int64_t>();
    const auto size = sizes.flat<int64_t>();
    TensorShape shape;  // an error, never TensorShape's CHECK abort, where it cannot be
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape({id.size(), image_bytes_}, &shape));
    Tensor* images = nullptr;
    Tensor* labels = nullptr;
    Tensor* proven = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &images));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ids.shape(), &labels));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &proven));
    auto label = labels->flat<int32_t>();
    uint8* row = images->flat<uint8>().data();
    const int64_t head_bytes = static_cast<int64_t>(head_.size());
    const int64_t laid_out = head_bytes + image_bytes_ + static_cast<int64_t>(tail_.size());
    std::string head(head_bytes, '\0');
    std::string rest;
    bool all = true;
    for (int64_t i = 0; i < id.size(); ++i, row += image_bytes_) {
      int64_t length = 0;
      OP_REQUIRES_OK(ctx, files_.CheckedSize(id(i), offset(i), size(i), &length));
      if (length < laid_out) {  // too short for the layout: read and checked, never trusted
        rest.resize(length);
        const iovec data = {rest.data(), rest.size()};
        OP_REQUIRES_OK(ctx, files_.ReadFramed(id(i), offset(i), length, &data, 1));
        std::memset(row, 0, image_bytes_);
        label(i) = 0;
        all = false;
        continue;
      }
      rest.resize(length - head_bytes - image_bytes_);
      const iovec data[3] = {{head.data(), head.size()},
                             {row, static_cast<size_t>(image_bytes_)},
                             {rest.data(), rest.size()}};
      OP_REQUIRES_OK(ctx, files_.ReadFramed(id(i), offset(i), length, data, 3));
      const bool laid = MatchesMasked(head.data(), head_, head_mask_) &&
                        MatchesMasked(rest.data(), tail_, tail_mask_);
      label(i) = laid ? static_cast<uint8>(rest[label_offset_ - head_bytes - image_bytes_]) : 0;
      all = all && laid;
    }
    proven->scalar<bool>()() = all;
  }

 private:
  ShardFiles files_;
  int64_t image_bytes_;
  int64_t label_offset_;
  std::string head_;
  std::string head_mask_;
  std::string tail_;
  std::string tail_mask_;
};

REGISTER_KERNEL_BUILDER(Name("ShardflowReadRawAt").Device(::tensorflow::DEVICE_CPU),
                        ReadRawAtOp);

}  // namespace shardflow
