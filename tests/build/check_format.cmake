# Every C/C++/CUDA source follows .clang-format. Fix with scripts/format.sh.
file(GLOB_RECURSE files ${SRC}/include/*.hpp ${SRC}/include/*.h ${SRC}/src/*.cpp ${SRC}/src/*.hpp ${SRC}/src/*.cu
     ${SRC}/src/*.cuh ${SRC}/apps/*.cpp ${SRC}/apps/*.hpp ${SRC}/bench/*.cpp ${SRC}/bench/*.hpp ${SRC}/tests/*.cpp
     ${SRC}/tests/*.hpp ${SRC}/tests/*.c ${SRC}/bindings/*.cpp ${SRC}/bindings/*.hpp ${SRC}/bindings/*.c
     ${SRC}/examples/*.c)
execute_process(COMMAND ${CLANG_FORMAT} --dry-run -Werror --style=file ${files}
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  string(SUBSTRING "${err}" 0 4000 err)
  message(FATAL_ERROR "files are not formatted; run scripts/format.sh\n${err}")
endif()
