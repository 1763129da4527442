#include "decode/jpeg_transcode.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <new>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <fmt/format.h>

#include "common/logging.h"
#include "decode/detail/libjpeg_glue.h"

#include <jerror.h>

// libjpeg-turbo exports the optimal-table builder its own two-pass encoder uses (LIBJPEG_6.2 ABI);
// its declaration lives in an internal header.
extern "C" void jpeg_gen_optimal_table(j_compress_ptr cinfo, JHUFF_TBL* htbl, long freq[]);

namespace stoke::decode {
namespace {

// Symbol counts for every Huffman table slot: what libjpeg's optimising first pass gathers.
struct Frequencies {
  long dc[NUM_HUFF_TBLS][257];
  long ac[NUM_HUFF_TBLS][257];
};

// The JPEG zigzag scan: the natural (row-major) index of the k-th coefficient in scan order.
constexpr uint8_t kNaturalOrder[64] = {0,  1,  8,  16, 9,  2,  3,  10, 17, 24, 32, 25, 18, 11, 4,  5,
                                       12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6,  7,  14, 21, 28,
                                       35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51,
                                       58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63};

// Natural-order non-zero masks to scan-order ones, a row of the block at a time: bits[r][m] is the
// scan-order mask of the coefficients of row r whose bits are set in m (16 KB). Built at compile
// time: a table filled by a static constructor would still be zero when another translation
// unit's static initialiser transcodes (a pack run from a test binary's initialiser did).
struct ZigzagMasks {
  uint64_t bits[8][256];
  constexpr ZigzagMasks() : bits() {
    uint8_t scan_of[64] = {};
    for (int k = 0; k < 64; ++k) scan_of[kNaturalOrder[k]] = static_cast<uint8_t>(k);
    for (int r = 0; r < 8; ++r) {
      for (int m = 0; m < 256; ++m) {
        for (int c = 0; c < 8; ++c) {
          if ((m >> c) & 1) bits[r][m] |= uint64_t{1} << scan_of[8 * r + c];
        }
      }
    }
  }
};
constexpr ZigzagMasks kZigzag;

int Bits(int v) { return v == 0 ? 0 : 32 - std::countl_zero(static_cast<uint32_t>(v < 0 ? -v : v)); }

// Bit n set when coefficient n (natural order) is not zero.
uint64_t NonZeroMask(const JCOEF* block) {
#if defined(__SSE2__)
  static_assert(sizeof(JCOEF) == 2);
  uint64_t mask = 0;
  const __m128i zero = _mm_setzero_si128();
  for (int i = 0; i < 4; ++i) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * i + 8));
    const __m128i z = _mm_packs_epi16(_mm_cmpeq_epi16(a, zero), _mm_cmpeq_epi16(b, zero));
    mask |= static_cast<uint64_t>(~_mm_movemask_epi8(z) & 0xFFFF) << (16 * i);
  }
  return mask;
#else
  uint64_t mask = 0;
  for (int n = 0; n < 64; ++n) mask |= static_cast<uint64_t>(block[n] != 0) << n;
  return mask;
#endif
}

// Counts one block's AC symbols as jchuff.c emits them in a sequential scan: a run of more than
// 15 zeros before a coefficient is a ZRL (0xF0) per 16, the symbol is run << 4 | size, and zeros
// after the last coefficient are one EOB (0x00).
void CountAc(const JCOEF* block, long* ac) {
  const uint64_t natural = NonZeroMask(block) & ~uint64_t{1};
  uint64_t zz = 0;
  for (int r = 0; r < 8; ++r) zz |= kZigzag.bits[r][(natural >> (8 * r)) & 0xFF];
  int last = 0;
  while (zz != 0) {
    const int k = std::countr_zero(zz);
    zz &= zz - 1;
    int run = k - last - 1;
    for (; run > 15; run -= 16) ac[0xF0]++;
    ac[(run << 4) + Bits(block[kNaturalOrder[k]])]++;
    last = k;
  }
  if (last < 63) ac[0]++;
}

// Counts every symbol the sequential encoder will emit for the coefficients of `d` written by `c`
// with a restart every `restart_mcus` MCUs: jctrans.c's MCU assembly (dummy blocks at the right and
// bottom edges take the previous block's DC and no AC) and jchuff.c's symbol rules, so that
// jpeg_gen_optimal_table builds exactly the tables libjpeg's own gathering pass would, at a
// fraction of its cost (one pass over the non-zero coefficients instead of a full trial encode).
void CountSymbols(j_decompress_ptr d, jvirt_barray_ptr* coefficients, j_compress_ptr c, int restart_mcus,
                  Frequencies* f) {
  std::memset(f, 0, sizeof *f);
  const int comps = d->num_components;
  int last_dc[MAX_COMPONENTS] = {};
  auto count_dc = [&](int ci, int dc) {
    f->dc[c->comp_info[ci].dc_tbl_no][Bits(dc - last_dc[ci])]++;
    last_dc[ci] = dc;
  };
  long mcus = 0;
  auto restart = [&] {
    if (restart_mcus > 0 && mcus > 0 && mcus % restart_mcus == 0) std::fill(last_dc, last_dc + comps, 0);
    ++mcus;
  };
  if (comps == 1) {  // one non-interleaved scan: an MCU is one block
    const jpeg_component_info& comp = d->comp_info[0];
    long* ac = f->ac[c->comp_info[0].ac_tbl_no];
    for (JDIMENSION row = 0; row < comp.height_in_blocks; ++row) {
      JBLOCKARRAY rows = (*d->mem->access_virt_barray)(reinterpret_cast<j_common_ptr>(d), coefficients[0], row, 1, FALSE);
      for (JDIMENSION col = 0; col < comp.width_in_blocks; ++col) {
        restart();
        count_dc(0, rows[0][col][0]);
        CountAc(rows[0][col], ac);
      }
    }
    return;
  }
  const int max_h = d->max_h_samp_factor, max_v = d->max_v_samp_factor;
  const JDIMENSION mcus_per_row = (d->image_width + 8 * max_h - 1) / (8 * max_h);
  const JDIMENSION mcu_rows = (d->image_height + 8 * max_v - 1) / (8 * max_v);
  JBLOCKARRAY rows[MAX_COMPONENTS];
  for (JDIMENSION mr = 0; mr < mcu_rows; ++mr) {
    for (int ci = 0; ci < comps; ++ci) {
      const jpeg_component_info& comp = d->comp_info[ci];
      rows[ci] = (*d->mem->access_virt_barray)(reinterpret_cast<j_common_ptr>(d), coefficients[ci],
                                               mr * static_cast<JDIMENSION>(comp.v_samp_factor),
                                               static_cast<JDIMENSION>(comp.v_samp_factor), FALSE);
    }
    for (JDIMENSION mc = 0; mc < mcus_per_row; ++mc) {
      restart();
      int previous_dc = 0;  // the DC of the block before, in this MCU (what a dummy block copies)
      for (int ci = 0; ci < comps; ++ci) {
        const jpeg_component_info& comp = d->comp_info[ci];
        const int h = comp.h_samp_factor, v = comp.v_samp_factor;
        const int last_col = static_cast<int>(comp.width_in_blocks % static_cast<JDIMENSION>(h));
        const int last_row = static_cast<int>(comp.height_in_blocks % static_cast<JDIMENSION>(v));
        const int blocks = mc + 1 < mcus_per_row ? h : (last_col == 0 ? h : last_col);
        long* ac = f->ac[c->comp_info[ci].ac_tbl_no];
        for (int y = 0; y < v; ++y) {
          int dummies = h;
          if (mr + 1 < mcu_rows || y < (last_row == 0 ? v : last_row)) {
            for (int x = 0; x < blocks; ++x) {
              const JCOEF* block = rows[ci][y][mc * static_cast<JDIMENSION>(h) + static_cast<JDIMENSION>(x)];
              count_dc(ci, block[0]);
              CountAc(block, ac);
              previous_dc = block[0];
            }
            dummies = h - blocks;
          }
          for (int x = 0; x < dummies; ++x) {
            count_dc(ci, previous_dc);
            ac[0]++;  // all zero: an EOB
          }
        }
      }
    }
  }
}

// A libjpeg destination that writes into a std::vector, growing it as needed.
struct VectorDestination {
  jpeg_destination_mgr pub;
  std::vector<std::byte>* out;
};

// Grows the vector to `size` bytes; out of memory becomes a libjpeg error (it longjmps), since
// an exception must not cross libjpeg's C frames.
void Grow(j_compress_ptr cinfo, size_t size) {
  auto* d = reinterpret_cast<VectorDestination*>(cinfo->dest);
  try {
    d->out->resize(size);
  } catch (const std::bad_alloc&) {
    cinfo->err->msg_code = JERR_OUT_OF_MEMORY;
    (*cinfo->err->error_exit)(reinterpret_cast<j_common_ptr>(cinfo));
  }
}

void InitDestination(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<VectorDestination*>(cinfo->dest);
  Grow(cinfo, std::max<size_t>(d->out->capacity(), 64 << 10));
  d->pub.next_output_byte = reinterpret_cast<JOCTET*>(d->out->data());
  d->pub.free_in_buffer = d->out->size();
}

boolean EmptyDestination(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<VectorDestination*>(cinfo->dest);
  const size_t used = d->out->size();  // libjpeg empties the whole buffer here
  Grow(cinfo, used * 2);
  d->pub.next_output_byte = reinterpret_cast<JOCTET*>(d->out->data()) + used;
  d->pub.free_in_buffer = d->out->size() - used;
  return TRUE;
}

void TerminateDestination(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<VectorDestination*>(cinfo->dest);
  d->out->resize(d->out->size() - d->pub.free_in_buffer);
}

uint16_t Be16(std::span<const std::byte> b, size_t at) {
  return static_cast<uint16_t>((static_cast<unsigned>(b[at]) << 8) | static_cast<unsigned>(b[at + 1]));
}

// What the headers before the scan say: the frame size, the MCU size and the restart interval.
struct FrameFacts {
  int width = 0, height = 0, mcu_w = 0, mcu_h = 0, restart = 0, scans = 0;
  bool baseline = false;
  size_t scan_data = 0;  // first entropy-coded byte
};

Result<FrameFacts> ParseFrame(std::span<const std::byte> jpeg) {
  FrameFacts f;
  if (jpeg.size() < 4 || jpeg[0] != std::byte{0xFF} || jpeg[1] != std::byte{0xD8}) {
    return CorruptError("restart index: not a JPEG");
  }
  size_t at = 2;
  for (;;) {
    if (at + 4 > jpeg.size() || jpeg[at] != std::byte{0xFF}) return CorruptError("restart index: bad marker layout");
    const auto marker = static_cast<uint8_t>(jpeg[at + 1]);
    const size_t len = Be16(jpeg, at + 2);
    if (len < 2 || at + 2 + len > jpeg.size()) return CorruptError("restart index: truncated marker segment");
    if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
      if (len < 8) return CorruptError("restart index: short frame header");
      f.baseline = marker == 0xC0 || marker == 0xC1;  // sequential Huffman (SOF1: 16-bit tables)
      f.height = Be16(jpeg, at + 5);
      f.width = Be16(jpeg, at + 7);
      const int comps = static_cast<int>(jpeg[at + 9]);
      int max_h = 1, max_v = 1;
      for (int c = 0; c < comps && at + 10 + 3 * static_cast<size_t>(c) + 2 <= at + 2 + len; ++c) {
        const auto hv = static_cast<int>(jpeg[at + 11 + 3 * static_cast<size_t>(c)]);
        max_h = std::max(max_h, hv >> 4);
        max_v = std::max(max_v, hv & 15);
      }
      f.mcu_w = 8 * (comps == 1 ? 1 : max_h);
      f.mcu_h = 8 * (comps == 1 ? 1 : max_v);
    } else if (marker == 0xDD && len >= 4) {
      f.restart = Be16(jpeg, at + 4);
    } else if (marker == 0xDA) {
      f.scan_data = at + 2 + len;
      return f;
    }
    at += 2 + len;
  }
}

}  // namespace

namespace {

// The restart offsets of a single-scan JPEG, and the entropy-coded bytes the scan holds without
// its markers and byte stuffing (what the encoder's bits fill).
struct ScanFacts {
  std::vector<uint32_t> offsets;
  uint64_t data_bytes = 0;
};

Result<ScanFacts> ScanEntropy(std::span<const std::byte> jpeg) {
  STOKE_ASSIGN_OR_RETURN(FrameFacts f, ParseFrame(jpeg));
  ScanFacts out;
  std::vector<uint32_t>& offsets = out.offsets;
  offsets.push_back(static_cast<uint32_t>(f.scan_data));
  uint64_t overhead = 0;  // marker and stuffing bytes inside the scan
  const auto* p = reinterpret_cast<const uint8_t*>(jpeg.data());
  size_t i = f.scan_data;
  int expect = 0;  // the next RSTn
  while (i < jpeg.size()) {
    const void* ff = std::memchr(p + i, 0xFF, jpeg.size() - i);
    if (ff == nullptr) break;
    i = static_cast<size_t>(static_cast<const uint8_t*>(ff) - p);
    if (i + 1 >= jpeg.size()) break;
    const uint8_t m = p[i + 1];
    if (m == 0x00 || m == 0xFF) {  // stuffed byte, or fill before a marker
      ++overhead;
      i += m == 0x00 ? 2 : 1;
      continue;
    }
    if (m >= 0xD0 && m <= 0xD7) {
      if (m != 0xD0 + expect) {
        return CorruptError(fmt::format("restart marker RST{} at {} where RST{} belongs", m - 0xD0, i, expect));
      }
      expect = (expect + 1) % 8;
      offsets.push_back(static_cast<uint32_t>(i + 2));
      overhead += 2;
      i += 2;
      continue;
    }
    if (m == 0xD9) {
      out.data_bytes = i - f.scan_data - overhead;
      return out;
    }
    return CorruptError(fmt::format("marker 0x{:02X} at {} inside the scan (a restart index needs one scan)", m, i));
  }
  return CorruptError("the scan has no end (EOI)");
}

// Bits the symbols counted in `f` take with the tables of `c`: each code, plus its magnitude bits
// (the symbol's size for DC, its low nibble for AC). Byte padding before markers is not included.
uint64_t CountedBits(j_compress_ptr c, const Frequencies& f) {
  uint64_t bits = 0;
  for (int t = 0; t < NUM_HUFF_TBLS; ++t) {
    for (int ac = 0; ac < 2; ++ac) {
      const JHUFF_TBL* table = ac ? c->ac_huff_tbl_ptrs[t] : c->dc_huff_tbl_ptrs[t];
      const long* freq = ac ? f.ac[t] : f.dc[t];
      if (table == nullptr) continue;
      int length_of[256] = {};
      for (int l = 1, k = 0; l <= 16; ++l) {
        for (int n = 0; n < table->bits[l]; ++n) length_of[table->huffval[k++]] = l;
      }
      for (int sym = 0; sym < 256; ++sym) {
        if (freq[sym] == 0) continue;
        const int extra = ac ? (sym & 15) : sym;
        bits += static_cast<uint64_t>(freq[sym]) * static_cast<uint64_t>(length_of[sym] + extra);
      }
    }
  }
  return bits;
}

}  // namespace

Result<std::vector<uint32_t>> FindRestartOffsets(std::span<const std::byte> jpeg) {
  STOKE_ASSIGN_OR_RETURN(ScanFacts facts, ScanEntropy(jpeg));
  return std::move(facts.offsets);
}

Status CheckRestartIndex(std::span<const std::byte> jpeg, const RestartIndex& index) {
  STOKE_ASSIGN_OR_RETURN(FrameFacts f, ParseFrame(jpeg));
  if (!f.baseline || f.mcu_w == 0) return CorruptError("restart index: the JPEG is not sequential Huffman-coded");
  const int grid_w = (f.width + f.mcu_w - 1) / f.mcu_w, grid_h = (f.height + f.mcu_h - 1) / f.mcu_h;
  if (index.restart_mcus <= 0 || index.restart_mcus != f.restart || index.mcus_per_row != grid_w ||
      index.mcu_rows != grid_h || grid_w % index.restart_mcus != 0 ||
      index.intervals != static_cast<size_t>(grid_w / index.restart_mcus) * static_cast<size_t>(grid_h)) {
    return CorruptError(fmt::format(
        "restart index: {} intervals of {} MCUs on a {} x {} grid; the JPEG has a {} x {} grid, restart interval {}",
        index.intervals, index.restart_mcus, index.mcus_per_row, index.mcu_rows, grid_w, grid_h, f.restart));
  }
  std::vector<uint32_t> listed;
  STOKE_RETURN_IF_ERROR(ExpandRestartOffsets(index, &listed));
  STOKE_ASSIGN_OR_RETURN(std::vector<uint32_t> found, FindRestartOffsets(jpeg));
  if (found.size() != listed.size()) {
    return CorruptError(fmt::format("restart index: {} intervals listed, the data has {}", listed.size(),
                                    found.size()));
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (found[i] != listed[i]) {
      return CorruptError(fmt::format("restart index: interval {} listed at {}, found at {}", i, listed[i], found[i]));
    }
  }
  return OkStatus();
}

struct JpegTranscoder::State {
  jpeg_decompress_struct dinfo;
  jpeg_compress_struct cinfo;
  detail::ErrorManager err;  // shared: one of the two objects is active at a time
  detail::ProgressManager progress;
  VectorDestination dest;
  Frequencies frequencies;
  bool broken = false;
};

JpegTranscoder::JpegTranscoder(DecoderOptions options, TranscodeOptions transcode)
    : options_(options), transcode_(transcode), state_(std::make_unique<State>()) {
  State* s = state_.get();
  s->dinfo.err = jpeg_std_error(&s->err.pub);
  s->cinfo.err = &s->err.pub;
  s->err.pub.error_exit = detail::OnError;
  s->err.pub.emit_message = detail::OnMessage;
  s->err.strict = true;
  s->err.warnings = 0;
  if (setjmp(s->err.jump)) {
    s->broken = true;
    return;
  }
  jpeg_create_decompress(&s->dinfo);
  jpeg_create_compress(&s->cinfo);
  s->progress.pub.progress_monitor = detail::OnProgress;
  s->progress.max_scans = options_.max_scans;
  s->dinfo.progress = &s->progress.pub;
  s->dest.pub.init_destination = InitDestination;
  s->dest.pub.empty_output_buffer = EmptyDestination;
  s->dest.pub.term_destination = TerminateDestination;
}

JpegTranscoder::~JpegTranscoder() {
  jpeg_destroy_compress(&state_->cinfo);
  jpeg_destroy_decompress(&state_->dinfo);
}

Status JpegTranscoder::Transcode(std::span<const std::byte> jpeg, TranscodedJpeg* out) {
  State* s = state_.get();
  if (s->broken) return InternalError(std::string("libjpeg: ") + s->err.message);
  if (jpeg.empty()) return CorruptError("empty input");
  jpeg_decompress_struct* d = &s->dinfo;
  jpeg_compress_struct* c = &s->cinfo;
  JpegInfo info;
  int k = 0, grid_w = 0, grid_h = 0;
  s->err.warnings = 0;
  if (setjmp(s->err.jump)) {
    jpeg_abort_compress(c);
    jpeg_abort_decompress(d);
    return Status(s->err.code, s->err.message);
  }
  detail::ReadHeaderInto(d, jpeg.data(), jpeg.size(), &info);
  if (static_cast<int64_t>(info.width) * info.height > options_.max_pixels) {
    jpeg_abort_decompress(d);
    return detail::PixelLimitError(info, options_.max_pixels);
  }
  // Reading every coefficient is the strict validation (warnings are errors).
  jvirt_barray_ptr* coefficients = jpeg_read_coefficients(d);
  if (!info.integral_sampling) {
    jpeg_abort_decompress(d);
    return CorruptError(detail::kFractionalSampling);
  }
  const bool gray = d->num_components == 1 && d->jpeg_color_space == JCS_GRAYSCALE;
  const bool color = d->num_components == 3 && (d->jpeg_color_space == JCS_YCbCr || d->jpeg_color_space == JCS_RGB);
  if (!gray && !color) {
    jpeg_abort_decompress(d);
    return UnavailableError(fmt::format("{} JPEG with {} components is kept as it is",
                                        ColorSpaceName(info.color_space), d->num_components));
  }
  {
    const bool single = d->num_components == 1;
    const int mcu_w = 8 * (single ? 1 : d->max_h_samp_factor), mcu_h = 8 * (single ? 1 : d->max_v_samp_factor);
    grid_w = (info.width + mcu_w - 1) / mcu_w;
    grid_h = (info.height + mcu_h - 1) / mcu_h;
    // The largest divisor of the row that gives at least intervals_per_row intervals (1 MCU for a
    // row narrower than that).
    const int want = std::max(1, transcode_.intervals_per_row);
    k = 1;
    for (int cand = std::max(1, grid_w / want); cand >= 1; --cand) {
      if (grid_w % cand == 0) {
        k = cand;
        break;
      }
    }
  }
  out->jpeg.clear();
  s->dest.out = &out->jpeg;
  jpeg_copy_critical_parameters(d, c);
  c->dest = &s->dest.pub;
  c->restart_interval = static_cast<unsigned>(k);
  c->restart_in_rows = 0;
  if (transcode_.fast_tables) {
    // Optimal tables from our own count of the symbols, then a single encoding pass.
    CountSymbols(d, coefficients, c, k, &s->frequencies);
    for (int t = 0; t < NUM_HUFF_TBLS; ++t) {
      bool dc_used = false, ac_used = false;
      for (int ci = 0; ci < c->num_components; ++ci) {
        dc_used |= c->comp_info[ci].dc_tbl_no == t;
        ac_used |= c->comp_info[ci].ac_tbl_no == t;
      }
      // jpeg_gen_optimal_table merges the counts it is given as it builds the code: hand it a
      // copy, the counts are needed again for the check below.
      long scratch[257];
      if (dc_used) {
        if (c->dc_huff_tbl_ptrs[t] == nullptr) c->dc_huff_tbl_ptrs[t] = jpeg_alloc_huff_table(reinterpret_cast<j_common_ptr>(c));
        std::memcpy(scratch, s->frequencies.dc[t], sizeof scratch);
        jpeg_gen_optimal_table(c, c->dc_huff_tbl_ptrs[t], scratch);
      }
      if (ac_used) {
        if (c->ac_huff_tbl_ptrs[t] == nullptr) c->ac_huff_tbl_ptrs[t] = jpeg_alloc_huff_table(reinterpret_cast<j_common_ptr>(c));
        std::memcpy(scratch, s->frequencies.ac[t], sizeof scratch);
        jpeg_gen_optimal_table(c, c->ac_huff_tbl_ptrs[t], scratch);
      }
    }
    c->optimize_coding = FALSE;
  } else {
    c->optimize_coding = TRUE;  // libjpeg's own two passes
  }
  jpeg_write_coefficients(c, coefficients);
  jpeg_finish_compress(c);
  jpeg_finish_decompress(d);

  out->info = info;
  out->info.progressive = false;
  out->restart_mcus = k;
  out->mcus_per_row = grid_w;
  out->mcu_rows = grid_h;
  STOKE_ASSIGN_OR_RETURN(ScanFacts scan, ScanEntropy(out->jpeg));
  out->offsets = std::move(scan.offsets);
  const size_t want_intervals = static_cast<size_t>(grid_w / k) * static_cast<size_t>(grid_h);
  if (out->offsets.size() != want_intervals) {
    return InternalError(fmt::format("transcode: {} restart intervals written, {} expected", out->offsets.size(),
                                     want_intervals));
  }
  if (transcode_.fast_tables && transcode_.check_counts) {
    // The symbols counted must be the symbols written: their codes and magnitude bits fill the
    // scan's data bytes but for at most 7 bits of padding per interval. A miscount (a symbol the
    // count missed has no code, and libjpeg would write it as nothing) breaks that, and the image
    // is transcoded again with libjpeg's own gathering pass.
    const uint64_t counted = CountedBits(c, s->frequencies), written = 8 * scan.data_bytes;
    if (counted > written || counted + 7 * want_intervals < written) {
      static std::atomic<int64_t> misses{0};
      if (misses.fetch_add(1) % 1000 == 0) {
        STOKE_LOG(WARN, "transcode: {} bits of symbols counted, {} written ({}x{}, {} components, restart {}); "
                  "using libjpeg's own tables", counted, written, info.width, info.height, c->num_components, k);
      }
      transcode_.fast_tables = false;
      Status again = Transcode(jpeg, out);
      transcode_.fast_tables = true;
      return again;
    }
  }
  return OkStatus();
}

}  // namespace stoke::decode
